"""The restartable-consumer seam: a signalled trainer rank (or one whose collective lost its peer) of a
consumer the keeper will resume does not publish ``consumer_failed`` (which would stop the producer
for good); anything else does."""

import pytest

from specforge_kimi.registration import RESTARTABLE_ENV


@pytest.fixture()
def channel(tmp_path):
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

    import specforge_kimi

    specforge_kimi.register()
    return StreamingRefChannel(str(tmp_path / "control" / "refs.jsonl"))


@pytest.mark.parametrize(
    "env, reason, published",
    [
        (None, "_WorkerTermination: 15", True),  # no keeper: SpecForge's behaviour
        ("0", "_WorkerTermination: 15", True),  # keeper without restarts left
        ("1", "_WorkerTermination: 15", False),  # keeper will resume: the producer must wait
        ("1", "RuntimeError: CUDA error: out of memory", True),  # a training error is always published
        # the surviving rank's collective fails before torchrun's SIGTERM arrives (seen on CPU with gloo)
        (
            "1",
            "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer "
            "[127.0.0.1]:36532",
            False,
        ),
        (
            "0",
            "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer "
            "[127.0.0.1]:36532",
            True,
        ),
        ("1", "DistBackendError: NCCL error: remote process exited or there was a network error", False),
    ],
)
def test_consumer_failed_sidecar(channel, monkeypatch, env, reason, published):
    if env is None:
        monkeypatch.delenv(RESTARTABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(RESTARTABLE_ENV, env)
    channel.mark_consumer_failed(reason)
    assert channel.consumer_stopped() is published
    assert channel.consumer_failure() == (reason if published else None)
