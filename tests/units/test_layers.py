"""The package's import graph has no cycle, function-level (lazy) imports included (issue 28: layers point one
way; lora.py and the bucketed gather (now weight_sync/gather.py) used to import each other)."""
import ast
import re

from launching import ROOT


def import_graph() -> dict[str, set[str]]:
    """Module -> the grpo_accel modules it imports anywhere in its file."""
    files = {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
             for f in (ROOT / "grpo_accel").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_accel"):
                deps |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("grpo_accel")}
        graph[name] = {d for d in deps if d in files and d != name and d != "grpo_accel"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_lazy_imports_included():
    graph = import_graph()
    assert {"grpo_accel.lora", "grpo_accel.weight_sync.gather", "grpo_accel.trainer"} <= set(graph)
    assert "grpo_accel.weight_sync.gather" not in graph["grpo_accel.lora"]
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]], "the check finds one"


def test_the_trainer_knows_contracts_not_rooms():
    """Issue 59: the trainer imported loss/ for its own arithmetic and rollout/ for its background thread; it reaches
    the objective and the collector through contracts.py alone."""
    graph = import_graph()
    trainer = {m: sorted(d for d in deps if room(d) in ("loss", "rollout")) for m, deps in graph.items()
               if m.startswith("grpo_accel.trainer")}
    assert len(trainer) >= 8 and {m: d for m, d in trainer.items() if d} == {}


def test_no_arrow_up_from_the_contracts():
    """Issue 59: contracts.py (every room's protocols) imported reporting/ for the samples' Markdown, while
    reporting/ imports contracts.py. The contracts import only the root's shared modules."""
    graph = import_graph()
    assert {d for d in graph["grpo_accel.contracts"] if d.count(".") > 1} == set()


FRONT_DOOR = ("config", "recipe", "run", "cli", "trl")
"""The rooms that speak in config keys (House 5: recipe/ re-zoned into the language, the assembly, the run's
outputs; trl/: TRL's Python API over the command); every other room is a component."""


def test_components_never_import_the_front_door_nor_raise_its_errors():
    """Layers point one way: the front door (config -> recipe -> run, cli) imports the components, never the
    reverse; a component raises its own errors naming its own arguments, and the recipe says which config key was
    meant. The config language imports neither its assembly nor the run's outputs."""
    graph = import_graph()
    inward = {m: sorted(d for d in deps if room(d) in FRONT_DOOR) for m, deps in graph.items()
              if room(m) not in FRONT_DOOR}
    assert len(inward) > 60 and {m: d for m, d in inward.items() if d} == {}
    language = {m: sorted(d for d in deps if room(d) in ("recipe", "run", "cli")) for m, deps in graph.items()
                if room(m) == "config"}
    assert len(language) >= 12 and {m: d for m, d in language.items() if d} == {}
    speaking = [f.relative_to(ROOT) for f in (ROOT / "grpo_accel").rglob("*.py")
                if not set(FRONT_DOOR) & set(f.parts) and re.search(r"\bConfigError\b", f.read_text())]
    assert speaking == []


def room(module: str) -> str:
    """The room a module lives in: its first folder under the package, or its own name at the root."""
    return (module.split(".") + [""])[1]


def test_the_package_root_holds_only_modules_several_rooms_share():
    """Issue 51: the root was a corridor of single-file modules. Each module left there is imported by at least two
    other rooms (or root modules) and its docstring's first line says so, naming every one of them (issue 59: "every
    room" was written where four rooms did not import it); a module used by one room lives in it."""
    graph = import_graph()
    root = sorted(m for m in graph if m.count(".") == 1 and (ROOT / "grpo_accel" / f"{room(m)}.py").exists())
    assert {"grpo_accel.batch", "grpo_accel.errors"} <= set(root) and "grpo_accel.loss" not in root
    wrong = {}
    for module in root:
        users = {room(m) for m, deps in graph.items() if module in deps} - {room(module)}
        text = (ROOT / "grpo_accel" / f"{room(module)}.py").read_text().removeprefix('"""')
        first = " ".join(text.split(".\n")[0].split()) + "."  # the first sentence, over several lines if need be
        named = set(re.findall(r"(\w+)(?:/|\.py)", first))
        if len(users) < 2 or not first.startswith("Shared by ") or named != users:  # "every room" was untrue
            wrong[module] = (sorted(users), first)
    assert wrong == {}


def probes(source: str) -> list[str]:
    """``hasattr(x, ...)`` and ``getattr(x, name, default)`` calls in ``source``: asking an object what it can do."""
    return [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and (node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3))]


def test_the_trainer_and_the_launcher_call_declared_contracts_without_probing_their_parts():
    """grpo_accel/contracts.py declares what each part provides; the trainer, its argument checks, the recipe's
    wiring and the training command call those members (compute_loss's ``getattr(loss, method)`` calls a method the user
    names, and raises when there is none: not a probe)."""
    names = ["grpo_accel/trainer/loop.py", "grpo_accel/trainer/args.py", "grpo_accel/recipe/build.py",
             "grpo_accel/contracts.py", "grpo_accel/cli/train.py"]
    assert {name: probes((ROOT / name).read_text()) for name in names} == {name: [] for name in names}
    assert len(probes("hasattr(x, 'a')\ngetattr(x, 'b', None)\ngetattr(x, 'c')")) == 2, "the check finds them"
    trainer = {str(p.relative_to(ROOT)): [line for line in probes(p.read_text()) if "hasattr(" in line]
               for p in sorted((ROOT / "grpo_accel" / "trainer").glob("*.py"))}
    assert len(trainer) > 5 and trainer == {name: [] for name in trainer}  # issue 65: no hasattr in trainer/


def test_every_python_file_is_at_most_400_lines_and_the_loop_350():
    files = sorted(p for d in ("grpo_accel", "launch", "tests") for p in (ROOT / d).rglob("*.py"))
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 400}
    assert len(files) > 90 and long == {}
    assert len((ROOT / "grpo_accel" / "trainer" / "loop.py").read_text().splitlines()) <= 350, "the loop stays short"


def test_launch_imports_nothing_from_tests():
    """House 5: launch/bench/ imported the tests' helpers and ran the SGLang stand-in from tests/; what both need
    lives in launch/bench/ (common.py, sglang_standin/), which the tests import."""
    files = sorted((ROOT / "launch").rglob("*.py"))
    reaching = {str(p.relative_to(ROOT)): line.strip() for p in files for line in p.read_text().splitlines()
                if re.search(r"\"tests\"|\btests[/.]helpers|\bfrom (launching|trainer_utils|start_memory) import", line)}
    assert len(files) > 15 and reaching == {}


def test_one_batch_layout_per_run(tmp_path, monkeypatch, tokenizer, tiny_model):
    """The recipe makes the run's BatchLayout once and hands it on; the collector and the trainer only read it
    (it used to be built five times in a multi-process run, and the trainer re-sharded the collector)."""
    from grpo_accel.layout import BatchLayout
    from trainer_utils import make_trainer, train_in_process

    made = []
    check = BatchLayout.__post_init__
    monkeypatch.setattr(BatchLayout, "__post_init__", lambda self: made.append(self) or check(self))
    train_in_process([f"output_dir={tmp_path}/run", "trainer.total_frames=128", "trainer.progress_bar=false",
                      "trainer.gradient_accumulation_steps=2"])
    assert len(made) == 1, "the recipe's one layout"
    made.clear()
    trainer = make_trainer(tokenizer, tiny_model, gradient_accumulation_steps=2)
    trainer.train()
    assert len(made) == 1 and trainer.layout is made[0] is trainer.collector.layout, "the Python API's: the user's"


ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc):`~?([\w.]+)`")
"""A docstring's reference to code (Sphinx's roles, which the API reference renders as links)."""


def _walk(obj, attrs: list[str]):
    for attr in attrs:
        obj = getattr(obj, attr, None)
    return obj


def _resolves(name: str, module, defined: dict[str, list]) -> bool:
    """``name`` is a dotted ``grpo_accel...`` path, an attribute chain from ``module`` or from one of its classes
    (a method named in its class's docstring), or from anything the package defines under its first part."""
    import importlib

    parts = name.split(".")
    if parts[0] == "grpo_accel":
        for cut in range(len(parts), 0, -1):
            try:
                return _walk(importlib.import_module(".".join(parts[:cut])), parts[cut:]) is not None
            except ImportError:
                continue
        return False
    classes = [v for v in vars(module).values() if isinstance(v, type)]
    return (any(_walk(start, parts) is not None for start in [module, *classes])
            or any(_walk(value, parts[1:]) is not None for value in defined.get(parts[0], [])))


def test_every_code_reference_in_a_docstring_names_something_that_exists():
    """Issue 51: docstrings named functions that no longer existed (``GRPOTrainer._step_normalizer``). Every
    :func:/:class:/:meth:/:mod:/:attr: reference in the package's docstrings resolves."""
    import importlib

    modules = {}
    for path in sorted((ROOT / "grpo_accel").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = (path, importlib.import_module(name))
    defined: dict[str, list] = {}
    for _, module in modules.values():
        for attr, value in vars(module).items():
            if getattr(value, "__module__", None) == module.__name__:
                defined.setdefault(attr, []).append(value)
    broken = []
    for name, (path, module) in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                broken += [f"{name}: {ref}" for ref in ROLE.findall(ast.get_docstring(node) or "")
                           if not _resolves(ref, module, defined)]
    assert broken == []
