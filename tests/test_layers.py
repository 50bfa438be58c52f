"""The package's import graph has no cycle, function-level (lazy) imports included (issue 28: layers point one
way; lora.py and weight_sync/gather.py used to import each other)."""
import ast

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
