"""``specforge-kimi setup``: apply our patch set to SpecForge and SpecForge's + ours to SGLang.

Scope: the pinned versions only -- a SpecForge checkout at commit a6b6b023 or the installed
``specforge==0.2.0`` wheel, and the installed ``sglang==0.5.14``. Each patch is classified
before anything is written: *applied* (reverse dry-run succeeds), *applicable* (forward dry-run
succeeds) or *drift* (neither: the target file changed under us; a clear error names the patch
and the files whose hunks fail). Dry runs and applies use ``--fuzz=0``: a hunk whose context lines
changed is drift, not a guess. A stack (SpecForge's capture patch, then ours, each editing what the
one before left) is read as its longest applied prefix, then the rest in order, so a half-applied
stack is finished rather than refused. ``--check`` classifies only. Applying twice is a no-op. The
inventory of what each patch touches and why is ``patches/README.md``.

Our patches go by name: ``patches/<project>/<pin>/NNNN-<name>.patch`` is ``<project>`` patch ``<name>`` (e.g.
SGLang patch ``spec-capture-cuda-ipc``); ``NNNN`` only orders the files. Code and messages use the name
(:func:`patch_name`, :func:`patch_file`).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from specforge_kimi.errors import KimiInputError
from specforge_kimi.provenance import patches_root

SPECFORGE_PIN_COMMIT = "a6b6b023"
SPECFORGE_PIN = "0.2.0"
SGLANG_PIN = "0.5.14"
CAPTURE_PATCH = Path("patches/sglang/v0.5.14/spec-capture.patch")  # inside a SpecForge checkout
#: where a checkout at the pinned commit comes from (errors and doctor name it)
GET_CHECKOUT = (
    f"git clone https://github.com/sgl-project/SpecForge && git -C SpecForge checkout {SPECFORGE_PIN_COMMIT} "
    "(or bash scripts/bootstrap.sh --gpu, which fetches it and runs setup)"
)


@dataclass
class PatchStatus:
    patch: Path
    root: Path
    strip: int
    state: str  # applied | applicable | drift
    files: list[str]
    detail: str = ""
    failed: list[str] = field(default_factory=list)  # drift: the files whose hunks fail


#: our patches by name, per project, in application order (a test checks these against the files)
KNOWN_PATCHES = {
    "specforge": (
        "load-plugins",
        "compact-capture-passthrough",
        "eagle3-keep-allocator-cache",
        "bf16-optimizer-fused-adamw",
        "eagle3-fewer-host-syncs",
        "eagle3-chunked-head-loss",
    ),
    "sglang": (
        "spec-capture-staging-buffer",
        "spec-capture-zero-copy",
        "spec-capture-parallel-put",
        "spec-capture-compact-passthrough",
        "spec-capture-cuda-ipc",
    ),
}
_PROJECT_LABEL = {"specforge": "SpecForge", "sglang": "SGLang"}


def patch_name(patch: Path | str) -> str:
    """A patch file's name less its order prefix and suffix: ``0005-spec-capture-cuda-ipc.patch`` ->
    ``spec-capture-cuda-ipc``."""
    return re.sub(r"^\d{4}-", "", Path(patch).name.removesuffix(".patch"))


def patch_file(project: str, name: str) -> Path:
    """Our ``project`` (``specforge`` or ``sglang``) patch ``name`` at the pin: its file under ``patches/``."""
    pin = {"specforge": SPECFORGE_PIN, "sglang": SGLANG_PIN}[project]
    found = [p for p in sorted((patches_root() / project / pin).glob("*.patch")) if patch_name(p) == name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} {project} patch files named {name} under {patches_root() / project / pin}")
    return found[0]


def _label(project: str, name: str) -> str:
    """How messages name a patch: ``SGLang patch spec-capture-cuda-ipc``."""
    return f"{_PROJECT_LABEL[project]} patch {name}"


def _files(patch: Path, strip: int) -> list[str]:
    out = []
    for line in patch.read_text().splitlines():
        m = re.match(r"^\+\+\+ (\S+)", line)
        if m:
            out.append("/".join(m.group(1).split("/")[strip:]))
    return out


def _dry(patch: Path, root: Path, strip: int, reverse: bool) -> subprocess.CompletedProcess:
    args = ["patch", f"-p{strip}", "-d", str(root), "--dry-run", "--batch", "--fuzz=0", "-f"]
    if reverse:
        args.append("-R")
    return subprocess.run(args + ["-i", str(patch)], capture_output=True, text=True)


def _failed_files(output: str) -> list[str]:
    """The files ``patch``'s dry-run output reports failing hunks for, in order."""
    failed: list[str] = []
    current = None
    for line in output.splitlines():
        m = re.match(r"^(?:checking|patching) file '?(.+?)'?$", line)
        if m:
            current = m.group(1)
        elif current and ("FAILED" in line or "saving rejects" in line) and current not in failed:
            failed.append(current)
    return failed


def classify(patch: Path, root: Path, strip: int) -> PatchStatus:
    if shutil.which("patch") is None:
        raise KimiInputError("the `patch` program is missing (apt-get install patch)")
    files = _files(patch, strip)
    missing = [f for f in files if not (root / f).is_file() and "/dev/null" not in f]
    new_files = [f for f in missing if _creates(patch, f)]
    missing = [f for f in missing if f not in new_files]
    if missing:
        return PatchStatus(patch, root, strip, "drift", files, f"files not found under {root}: {missing}")
    if _dry(patch, root, strip, reverse=True).returncode == 0:
        return PatchStatus(patch, root, strip, "applied", files)
    fwd = _dry(patch, root, strip, reverse=False)
    if fwd.returncode == 0:
        return PatchStatus(patch, root, strip, "applicable", files)
    out = (fwd.stdout + fwd.stderr).strip()
    return PatchStatus(patch, root, strip, "drift", files, out[-400:], _failed_files(out))


def _creates(patch: Path, rel: str) -> bool:
    text = patch.read_text()
    return bool(re.search(r"^--- /dev/null\n\+\+\+ \S*" + re.escape(rel) + r"\s*$", text, re.M))


def apply(status: PatchStatus) -> None:
    res = subprocess.run(
        [
            "patch",
            f"-p{status.strip}",
            "-d",
            str(status.root),
            "--batch",
            "--forward",
            "--fuzz=0",
            "--no-backup-if-mismatch",
            "-i",
            str(status.patch),
        ],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise KimiInputError(f"applying {status.patch} to {status.root} failed: {(res.stdout + res.stderr)[-400:]}")


def specforge_root(checkout: str | None) -> Path:
    """Directory holding ``specforge/``: the checkout (at the pinned commit) or site-packages."""
    if checkout:
        root = Path(checkout)
        if not (root / "specforge" / "cli.py").is_file():
            raise KimiInputError(f"{root} is not a SpecForge checkout (no specforge/cli.py)")
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0 and not head.stdout.strip().startswith(SPECFORGE_PIN_COMMIT):
            raise KimiInputError(f"{root} is at {head.stdout.strip()[:12]}, patches are for {SPECFORGE_PIN_COMMIT}")
        return root
    return _installed_root("specforge", SPECFORGE_PIN, "and no --specforge-checkout was given")


def sglang_root() -> Path:
    return _installed_root("sglang", SGLANG_PIN)


def _installed_root(package: str, pin: str, hint: str = "") -> Path:
    """site-packages directory of the installed ``package``, which must be at ``pin``."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version(package)
    except PackageNotFoundError:
        raise KimiInputError(f"{package} is not installed {hint}".strip()) from None
    if v != pin:
        raise KimiInputError(f"installed {package} is {v}; the patches are for {pin}")
    return Path(importlib.util.find_spec(package).origin).parent.parent


def _scratch_copy(site: Path, rels, dest: Path) -> Path:
    """Copy the files ``rels`` that exist under ``site`` to the same paths under ``dest``."""
    for rel in rels:
        if (site / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(site / rel, dest / rel)
    return dest


def _classify_after(patch: Path, site: Path, prior: list[PatchStatus]) -> PatchStatus:
    """Classify ``patch`` as it will meet ``site`` once the ``applicable`` ``prior`` patches are in:
    on a scratch copy of the files they touch (ours edit a file SpecForge's capture patch creates)."""
    import tempfile

    pending = [s for s in prior if s.state == "applicable"]
    if not pending:
        return classify(patch, site, 2)
    with tempfile.TemporaryDirectory(prefix="specforge-kimi-patch-") as tmp:
        scratch = _scratch_copy(site, {f for s in pending for f in s.files} | set(_files(patch, 2)), Path(tmp))
        for s in pending:
            apply(PatchStatus(s.patch, scratch, s.strip, s.state, s.files))
        status = classify(patch, scratch, 2)
    status.root = site
    if status.state == "drift":
        status.detail = f"after {', '.join(s.patch.name for s in pending)}: {status.detail}"
    return status


def _applied_prefix(patches: list[Path], site: Path) -> int:
    """How many leading patches of the stack are in ``site``: the largest k whose patches reverse,
    last first, on a scratch copy (a later patch edits what an earlier one left, so an earlier one
    alone no longer reverses once a later one is in)."""
    import tempfile

    for k in range(len(patches), 0, -1):
        with tempfile.TemporaryDirectory(prefix="specforge-kimi-patch-") as tmp:
            scratch = _scratch_copy(site, {f for p in patches[:k] for f in _files(p, 2)}, Path(tmp))
            for p in reversed(patches[:k]):
                if _dry(p, scratch, 2, reverse=True).returncode != 0:
                    break
                subprocess.run(
                    ["patch", "-p2", "-d", str(scratch), "-R", "--batch", "--fuzz=0", "-i", str(p)], capture_output=True
                )
            else:
                return k
    return 0


def classify_stack(stack: list[Path], site: Path) -> list[PatchStatus]:
    """Each patch of an ordered stack (``-p2`` into ``site``) with its state: the longest applied prefix is
    *applied*; each later one is classified as it will meet the tree after the ones before it."""
    k = _applied_prefix(stack, site)
    statuses = [PatchStatus(p, site, 2, "applied", _files(p, 2)) for p in stack[:k]]
    rest: list[PatchStatus] = []
    for p in stack[k:]:
        rest.append(_classify_after(p, site, rest))
    return statuses + rest


def plan(checkout: str | None, *, sglang: bool, sglang_site: Path | None = None) -> list[PatchStatus]:
    """Every patch with its state; SGLang patches only when ``sglang`` (needs the checkout).

    SGLang patches are listed in application order (SpecForge's capture patch, then ours), each
    classified as it will meet the tree after the ones before it."""
    root = patches_root()
    statuses = [
        classify(p, specforge_root(checkout), 1) for p in sorted((root / "specforge" / SPECFORGE_PIN).glob("*.patch"))
    ]
    if sglang:
        if not checkout:
            raise KimiInputError(
                "SGLang's capture patch ships only in a SpecForge checkout: pass --specforge-checkout DIR "
                f"(or --no-sglang to patch SpecForge alone); get one with {GET_CHECKOUT}"
            )
        capture = Path(checkout) / CAPTURE_PATCH
        if not capture.is_file():
            raise KimiInputError(f"{capture} not found in the SpecForge checkout")
        site = sglang_site or sglang_root()
        statuses += classify_stack([capture, *our_sglang_patches()], site)
    return statuses


def our_sglang_patches() -> list[Path]:
    """``patches/sglang/<pin>/*.patch`` in application order."""
    return sorted((patches_root() / "sglang" / SGLANG_PIN).glob("*.patch"))


#: the two patches ``server.compact_passthrough`` needs: our SpecForge producer side and our SGLang sink side
COMPACT_SPECFORGE_PATCH = "compact-capture-passthrough"
COMPACT_SGLANG_PATCH = "spec-capture-compact-passthrough"


def compact_passthrough_gaps(
    *, specforge_site: Path | None = None, sglang_site: Path | None = None, sglang: bool = True
) -> list[str]:
    """What keeps ``server.compact_passthrough`` from working on the installed (or given) trees: one line per
    compact patch that is not applied (empty when all are; the SGLang half only with ``sglang``). Without the
    SpecForge half the producer silently sends the JSON lists again; without the SGLang half the server
    refuses the compact items, so a launch checks this first (``launch.preflight``)."""
    checks = [("specforge", COMPACT_SPECFORGE_PATCH, 1, lambda: specforge_site or specforge_root(None))]
    if sglang:
        checks.append(("sglang", COMPACT_SGLANG_PATCH, 2, lambda: sglang_site or sglang_root()))
    gaps = []
    for project, name, strip, site_of in checks:
        try:
            site = site_of()
        except KimiInputError as e:
            gaps.append(f"{_label(project, name)}: {e}")
            continue
        patch = patch_file(project, name)
        state = _sglang_state(patch, site) if strip == 2 else classify(patch, site, strip).state
        if state != "applied":
            gaps.append(f"{_label(project, name)} is not applied to {site} ({state})")
    return gaps


def specforge_patch_gaps(names: list[str], *, specforge_site: Path | None = None) -> list[str]:
    """Which of our SpecForge patches ``names`` (:data:`KNOWN_PATCHES` names) are not applied to the installed (or
    given) SpecForge: one line each, empty when all are."""
    try:
        site = specforge_site or specforge_root(None)
    except KimiInputError as e:
        return [f"{_label('specforge', name)}: {e}" for name in names]
    gaps = []
    for name in names:
        state = classify(patch_file("specforge", name), site, 1).state
        if state != "applied":
            gaps.append(f"{_label('specforge', name)} is not applied to {site} ({state})")
    return gaps


def _sglang_state(patch: Path, site: Path) -> str:
    """One of our SGLang patches' state read as part of the stack (a later patch editing the same lines keeps an
    earlier one from reversing alone)."""
    return {s.patch.name: s.state for s in classify_stack(our_sglang_patches(), site)}[patch.name]


#: the SGLang patch ``server.transport: cuda_ipc`` needs (the capture server's pool)
CUDA_IPC_SGLANG_PATCH = "spec-capture-cuda-ipc"


def cuda_ipc_gaps(*, sglang_site: Path | None = None) -> list[str]:
    """What keeps ``server.transport: cuda_ipc`` from working on the installed (or given) SGLang: one line when
    SGLang patch ``spec-capture-cuda-ipc`` is not applied (empty when it is). Without it the server ignores the transport and writes
    to Mooncake, so a launch checks this first (``launch.preflight``)."""
    try:
        site = sglang_site or sglang_root()
    except KimiInputError as e:
        return [f"{_label('sglang', CUDA_IPC_SGLANG_PATCH)}: {e}"]
    state = _sglang_state(patch_file("sglang", CUDA_IPC_SGLANG_PATCH), site)
    return (
        [] if state == "applied" else [f"{_label('sglang', CUDA_IPC_SGLANG_PATCH)} is not applied to {site} ({state})"]
    )


def load_patched_specforge_module(rel: str, scratch: Path):
    """The installed SpecForge's file ``rel`` (e.g. ``specforge/inference/adapters/server_capture.py``)
    as our SpecForge patches leave it, imported from a copy under ``scratch``: the install is not
    touched. For tests and CPU benches of a patched code path on an unpatched wheel."""
    import importlib.util
    import sys

    site = specforge_root(None)
    touching = [
        p for p in sorted((patches_root() / "specforge" / SPECFORGE_PIN).glob("*.patch")) if rel in _files(p, 1)
    ]
    # a patch that also edits other files is classified against all of them
    root = _scratch_copy(site, sorted({rel, *(f for p in touching for f in _files(p, 1))}), Path(scratch))
    for patch in touching:
        status = classify(patch, root, 1)
        if status.state == "drift":
            raise KimiInputError(f"{patch} does not apply to {site / rel}. {status.detail}")
        if status.state == "applicable":
            apply(status)
    name = "specforge_kimi_patched_" + rel.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, root / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``setup`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    p.add_argument(
        "--specforge-checkout",
        default=None,
        help="SpecForge checkout at a6b6b023 (patched in place; its SGLang capture patch is applied "
        "to the installed sglang). Without it the installed specforge 0.2.0 is patched.",
    )
    p.add_argument("--check", action="store_true", help="dry run: report each patch's state, change nothing")
    p.add_argument("--no-sglang", action="store_true", help="leave the installed sglang alone")


def run(args: argparse.Namespace) -> int:
    statuses = plan(args.specforge_checkout, sglang=not args.no_sglang)
    drift = [s for s in statuses if s.state == "drift"]
    for s in statuses:
        print(f"{s.state:10s} {s.patch.name:40s} -> {s.root} ({', '.join(s.files)})")
    if drift:
        s = drift[0]
        where = ", ".join(f"{s.root}/{f}" for f in (s.failed or s.files[:1]))
        raise KimiInputError(
            f"{s.patch} does not apply to {where}: the file changed (version drift, or an older "
            f"specforge-kimi's patches are in: reinstall that package at its pin and run setup "
            f"again). {s.detail}"
        )
    note = _imported_elsewhere(args.specforge_checkout)
    if note:
        print(note)
    if args.check:
        return 0
    for s in statuses:
        if s.state == "applicable":
            apply(s)
            print(f"applied    {s.patch.name}")
    return 0


def _imported_elsewhere(checkout: str | None) -> str:
    """A note when ``--specforge-checkout`` is not the specforge this Python imports (patching it then
    leaves what runs unpatched); empty otherwise."""
    if not checkout:
        return ""
    import importlib.util

    spec = importlib.util.find_spec("specforge")
    if spec is None or not spec.origin:
        return ""
    imported = Path(spec.origin).resolve().parent
    if imported == (Path(checkout) / "specforge").resolve():
        return ""
    return (
        f"note: this Python imports specforge from {imported}, not from {checkout}: install the checkout "
        f"(pip install -e {checkout}) or also patch the installed one (specforge-kimi setup --no-sglang)"
    )
