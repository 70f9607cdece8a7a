"""The two-node recipe's per-node launch plans (nothing is started): what each node runs, where it
keeps its supervisor state, and which address Mooncake and SGLang use on it."""

from pathlib import Path

import pytest

from specforge_kimi.errors import KimiInputError
from specforge_kimi.plan.run_plan import compile_plan
from specforge_kimi.run.launch import build_colocated_plan

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "kimi-k25-2x8xb300.yaml"


@pytest.fixture(scope="module")
def recipe_and_rendered(tmp_path_factory):
    compiled = compile_plan(RECIPE, rendered_dir=tmp_path_factory.mktemp("rendered"))
    return compiled, compiled.write()


def _by_name(plan):
    return ({s.command.label: s for s in plan.services}, {c.label: c for c in plan.commands})


def test_node0_runs_the_shared_services_with_its_own_address(recipe_and_rendered):
    compiled, _ = recipe_and_rendered
    recipe = compiled.recipe
    plan = build_colocated_plan(compiled, node_rank=0)
    services, commands = _by_name(plan)
    assert {"mooncake", "capture-server"} <= set(services) and {"producer", "consumer"} == set(commands)
    assert services["capture-server"].command.env["MOONCAKE_LOCAL_HOSTNAME"] == recipe.server.host
    assert commands["consumer"].env["MOONCAKE_LOCAL_HOSTNAME"] == recipe.server.host
    assert plan.managed_root.endswith("/supervisor")


def test_other_nodes_use_their_own_address_and_supervisor_dir(recipe_and_rendered):
    compiled, _ = recipe_and_rendered
    plan = build_colocated_plan(compiled, node_rank=1, local_host="10.0.0.2")
    services, commands = _by_name(plan)
    assert set(services) == {"capture-server"} and set(commands) == {"consumer"}  # no second master or producer
    server = services["capture-server"].command
    assert server.env["MOONCAKE_LOCAL_HOSTNAME"] == "10.0.0.2"
    assert server.argv[list(server.argv).index("--host") + 1] == "10.0.0.2"
    assert server.argv[list(server.argv).index("--node-rank") + 1] == "1"
    assert commands["consumer"].env["MOONCAKE_LOCAL_HOSTNAME"] == "10.0.0.2"
    assert "--node_rank=1" in commands["consumer"].argv
    node0 = build_colocated_plan(compiled, node_rank=0)
    assert plan.managed_root != node0.managed_root and plan.managed_root.endswith("/supervisor-node1")
    assert plan.managed_ports == ()


def test_other_nodes_must_name_their_address(recipe_and_rendered):
    compiled, _ = recipe_and_rendered
    with pytest.raises(KimiInputError, match="needs --local-host"):
        build_colocated_plan(compiled, node_rank=1)


def test_the_ledger_stays_on_node0s_own_disk(recipe_and_rendered):
    compiled, rendered = recipe_and_rendered
    recipe = compiled.recipe
    state = rendered["specforge_config"]["deployment"]["disaggregated"]["consumer_state_dir"]
    assert state == recipe.trainer.consumer_state_dir and not state.startswith(recipe.output_dir)


def test_run_report_reads_the_ledger_where_the_config_put_it(tmp_path):
    import sqlite3

    import yaml

    from specforge_kimi.run.ledger import durable_step

    run, state = tmp_path / "run", tmp_path / "node-local" / "consumer-state"
    (run / "rendered").mkdir(parents=True)
    state.mkdir(parents=True)
    (run / "rendered" / "specforge_run.yaml").write_text(
        yaml.safe_dump({"deployment": {"disaggregated": {"consumer_state_dir": str(state)}}})
    )
    con = sqlite3.connect(state / "consumer.sqlite")
    con.execute("create table marker (k text primary key, v)")
    con.execute("insert into marker values ('global_step', 42)")
    con.commit()
    con.close()
    assert durable_step(run) == 42


def test_run_report_finds_a_moved_run_dirs_default_ledger(tmp_path):
    """The default ledger follows the run directory (a relative output_dir, or a run copied off the box)."""
    import sqlite3

    import yaml

    from specforge_kimi.run.ledger import durable_step

    run = tmp_path / "fetched" / "tiny-k25-tp1"
    (run / "rendered").mkdir(parents=True)
    (run / "consumer-state").mkdir()
    (run / "rendered" / "specforge_run.yaml").write_text(
        yaml.safe_dump(
            {
                "output_dir": "runs/tiny-k25-tp1",
                "deployment": {"disaggregated": {"consumer_state_dir": "runs/tiny-k25-tp1/consumer-state"}},
            }
        )
    )
    con = sqlite3.connect(run / "consumer-state" / "consumer.sqlite")
    con.execute("create table marker (k text primary key, v)")
    con.execute("insert into marker values ('global_step', 7)")
    con.commit()
    con.close()
    assert durable_step(run) == 7
