"""The environment-variable table (``specforge_kimi.environment``) against the code.

Every ``SPECFORGE_KIMI_*`` name written anywhere in ``src/`` and every name an environment read or write in
``src/`` uses is a row; every row is used somewhere in ``src/``; the modules a row names as its writers and
readers, and the patches it names, contain it. "Contains" means: the name as a string literal, the table's
constant (``environment.TRANSPORT``), or a module constant defined from either (``TRANSPORT_ENV``).

Environment reads and writes are found by an AST walk (``_env_sites``): ``<env>[NAME]``, ``<env>.get/pop/
setdefault(NAME)``, ``os.getenv(NAME)``, a local ``get = os.environ.get`` called with NAME, and the keys of a
dict that is an environment (assigned to or returned as one, passed as ``env=``, spreading one, or given to
``<env>.update``), where ``<env>`` is ``os.environ`` or any name or attribute called ``env``, ``environ`` or
``*_env`` / ``*_ENV``. ``test_the_walk_sees_each_form`` shows the walk finds each form.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from package_modules import modules

from specforge_kimi import environment

ROOT = Path(__file__).resolve().parents[2]
TABLE_MODULE = "environment"
ROW_CONST = {attr: v for attr, v in vars(environment).items() if isinstance(v, environment.EnvVar)}
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")
ENVISH = re.compile(r"(^|_)env(iron)?$", re.IGNORECASE)
OURS = re.compile(r"SPECFORGE_KIMI_[A-Z0-9_]+")


MODULES = modules()
TREES = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}


# -- the environment-site walk -------------------------------------------------------------------------------
def _envish(node: ast.AST | None) -> bool:
    if isinstance(node, ast.Name):
        return bool(ENVISH.search(node.id))
    if isinstance(node, ast.Attribute):
        return bool(ENVISH.search(node.attr))
    if isinstance(node, ast.IfExp):
        return _envish(node.body) or _envish(node.orelse)
    if isinstance(node, ast.BoolOp):
        return any(_envish(v) for v in node.values)
    return False


def _literal(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.match(node.value):
        return node.value
    return None


def _env_dicts(tree: ast.AST) -> list[ast.Dict]:
    """Dict literals that are environments."""
    found: list[ast.Dict] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_envish(t) for t in targets) and isinstance(node.value, ast.Dict):
                found.append(node.value)
        elif isinstance(node, ast.Call):
            found += [k.value for k in node.keywords if k.arg == "env" and isinstance(k.value, ast.Dict)]
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "update" and _envish(f.value):
                found += [a for a in node.args if isinstance(a, ast.Dict)]
        elif isinstance(node, ast.FunctionDef) and ENVISH.search(node.name):
            found += [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and isinstance(r.value, ast.Dict)]
        if isinstance(node, ast.Dict) and any(
            k is None and _envish(v) for k, v in zip(node.keys, node.values, strict=True)
        ):
            found.append(node)  # {**os.environ, ...}, {**plan.server_env, ...}
    return found


def _getter_names(tree: ast.AST) -> set[str]:
    """Names bound to an environment's ``get`` (``env = os.environ.get``)."""
    return {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "get"
        and _envish(node.value.value)
        for t in node.targets
        if isinstance(t, ast.Name)
    }


def _env_sites(tree: ast.AST) -> set[str]:
    """Literal names that ``tree``'s environment reads and writes use."""
    names: set[str] = set()
    getters = _getter_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _envish(node.value):
            names.add(_literal(node.slice))
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _envish(f.value):
                names.add(_literal(node.args[0]))
            elif isinstance(f, ast.Attribute) and f.attr in ("getenv", "putenv", "unsetenv"):
                names.add(_literal(node.args[0]))
            elif isinstance(f, ast.Name) and f.id in getters:
                names.add(_literal(node.args[0]))
        elif isinstance(node, ast.Assign) and any(_envish(t) for t in node.targets):
            values = node.value.elts if isinstance(node.value, ast.Tuple | ast.List) else [node.value]
            names.update(_literal(v) for v in values)  # FOO_ENV = "FOO", _DIST_ENV = ("RANK", ...)
    for d in _env_dicts(tree):
        names.update(_literal(k) for k in d.keys if k is not None)
    names.discard(None)
    return names


# -- what a module contains: literals, the table's constants, constants defined from them ------------------------
def _table_refs(tree: ast.AST) -> set[str]:
    """Row names ``tree`` reaches through the table module (``from ...environment import X``, ``env_mod.X``)."""
    rows, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[-1] == TABLE_MODULE:
                rows.update(ROW_CONST[a.name].name for a in node.names if a.name in ROW_CONST)
            aliases.update(a.asname or a.name for a in node.names if a.name == TABLE_MODULE)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name.endswith("." + TABLE_MODULE) and a.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr in ROW_CONST:
                rows.add(ROW_CONST[node.attr].name)
    return rows


def _value_names(node: ast.AST, tree: ast.AST) -> set[str]:
    """Row names a module-level constant's value holds (literals and table constants)."""
    refs = _table_refs(tree)
    found = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in environment.BY_NAME}
    for n in ast.walk(node):
        attr = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else None
        if attr in ROW_CONST and ROW_CONST[attr].name in refs:
            found.add(ROW_CONST[attr].name)
    return found


def _constants() -> dict[str, set[str]]:
    """Module constants of ``src/`` defined from table names: identifier -> the row names it stands for."""
    consts: dict[str, set[str]] = {}
    for module, tree in TREES.items():
        if module == TABLE_MODULE:
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                held = _value_names(node.value, tree)
                name = node.targets[0].id
                if held:
                    assert consts.get(name, held) == held, f"{name} stands for different variables in two modules"
                    consts[name] = held
    return consts


CONSTANTS = _constants()


def _contains(module: str) -> set[str]:
    tree = TREES[module]
    found = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in environment.BY_NAME}
    found |= _table_refs(tree)
    for node in ast.walk(tree):
        ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        found |= CONSTANTS.get(ident, set())
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                found |= CONSTANTS.get(a.name, set())
    return found


CONTAINS = {m: _contains(m) for m in MODULES if m != TABLE_MODULE}


# -- the checks ------------------------------------------------------------------------------------------------
def test_every_specforge_kimi_name_in_src_is_a_row():
    missing = {
        f"{name} ({module})"
        for module, path in MODULES.items()
        for name in OURS.findall(path.read_text())
        if name not in environment.BY_NAME
    }
    assert not missing, f"SPECFORGE_KIMI_* names not in specforge_kimi/environment.py: {sorted(missing)}"


def test_every_environment_read_and_write_is_a_row():
    missing = {
        f"{name} ({module})"
        for module, tree in TREES.items()
        if module != TABLE_MODULE
        for name in _env_sites(tree)
        if name not in environment.BY_NAME
    }
    assert not missing, f"environment variables not in specforge_kimi/environment.py: {sorted(missing)}"


def test_our_names_come_from_the_table():
    """Code names a ``SPECFORGE_KIMI_*`` variable through the table, never by a literal of its own."""
    literal = sorted(
        f"{node.value} ({module})"
        for module, tree in TREES.items()
        if module != TABLE_MODULE
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and OURS.fullmatch(node.value)
    )
    assert not literal, f"take these from specforge_kimi.environment: {literal}"


@pytest.mark.parametrize("row", environment.TABLE, ids=lambda r: r.name)
def test_row_is_used_in_src(row):
    users = sorted(m for m, names in CONTAINS.items() if row.name in names)
    assert users, f"{row.name} is in the table but nothing in src/ uses it"


@pytest.mark.parametrize("row", environment.TABLE, ids=lambda r: r.name)
def test_row_writers_and_readers_contain_it(row):
    named = [*row.writers, *row.readers]
    unknown = [m for m in named if m not in CONTAINS]
    assert not unknown, f"{row.name}: no module {unknown} in specforge_kimi"
    absent = sorted({m for m in named if row.name not in CONTAINS[m]})
    assert not absent, f"{row.name}: named as written or read by {absent}, which do not contain it"


@pytest.mark.parametrize("row", environment.TABLE, ids=lambda r: r.name)
def test_row_is_well_formed(row):
    assert ENV_NAME.match(row.name) and row.meaning.strip() and "\n" not in row.meaning
    assert row.owner in (environment.OURS, environment.OUR_PATCH, environment.LIBRARY)
    assert (row.owner == environment.OURS) == row.name.startswith("SPECFORGE_KIMI_"), row.owner
    if row.owner != environment.OURS:
        assert row.outside or row.patches, f"{row.name}: say who outside this package reads it"
    for patch in row.patches:
        library, name = patch.split("/")
        files = list((ROOT / "patches" / library).glob(f"*/[0-9][0-9][0-9][0-9]-{name}.patch"))
        assert len(files) == 1, f"{row.name}: patch {patch} not found under patches/{library}/"
        assert row.name in files[0].read_text(), f"{row.name}: patch {patch} does not contain it"


def test_names_unique_and_every_row_declared_in_the_table():
    assert len(environment.BY_NAME) == len(environment.TABLE)
    assert set(ROW_CONST.values()) == set(environment.TABLE)


# -- the walk itself -------------------------------------------------------------------------------------------
WALK_FORMS = {
    "A_SUB": 'os.environ["A_SUB"] = "1"',
    "A_GET": 'x = os.environ.get("A_GET", "0")',
    "A_POP": 'os.environ.pop("A_POP", None)',
    "A_DEFAULT": 'os.environ.setdefault("A_DEFAULT", "1")',
    "A_GETENV": 'x = os.getenv("A_GETENV")',
    "A_IFEXP": 'x = (os.environ if e is None else e).get("A_IFEXP")',
    "A_GETTER": 'def f():\n    env = os.environ.get\n    return env("A_GETTER")',
    "A_CONST": 'FOO_ENV = "A_CONST"',
    "A_TUPLE": '_DIST_ENV = ("A_TUPLE", "B")',
    "A_DICT": 'env = {"A_DICT": "1"}',
    "A_KWARG": 'subprocess.Popen(argv, env={**os.environ, "A_KWARG": ""})',
    "A_SPREAD": 'CommandSpec("x", argv, {**plan.server_env, "A_SPREAD": ""})',
    "A_UPDATE": 'env.update({"A_UPDATE": "1"})',
    "A_RETURN": 'def server_env(r):\n    return {"A_RETURN": "1"}',
    "A_ATTR_SUB": 'c.env["A_ATTR_SUB"] = "1"',
}


@pytest.mark.parametrize("name", sorted(WALK_FORMS))
def test_the_walk_sees_each_form(name):
    assert name in _env_sites(ast.parse(WALK_FORMS[name]))


def test_the_walk_ignores_what_is_no_environment():
    source = 'sheet.get("ENV_LIKE")\nresult = {"NOT_ENV": 1}\nd["KEY_NAME"] = 2\nLOCK_FILE = "LAUNCH_LOCK"'
    assert _env_sites(ast.parse(source)) == set()


def test_the_walk_finds_the_code_s_own_sites():
    """Not vacuous on the real tree: names we know are read or written, each by a different form."""
    assert "MOONCAKE_PROTOCOL" in _env_sites(TREES["run.segment_keeper"])  # env = os.environ.get
    assert "CUDA_VISIBLE_DEVICES" in _env_sites(TREES["plan.devices"])  # (os.environ if ... else ...).get
    assert "MOONCAKE_LOCAL_BUFFER_SIZE" in _env_sites(TREES["servers.capture_server"])  # env = {...}
    assert "SPECFORGE_PLUGINS" in _env_sites(TREES["cli"])  # os.environ[...] = ...
    assert CONSTANTS["TRANSPORT_ENV"] == {"SPECFORGE_KIMI_TRANSPORT"}
    assert "SPECFORGE_KIMI_RESUME_SKIP" in CONTAINS["run.resume"]  # through registration.RESUME_SKIP_ENV
