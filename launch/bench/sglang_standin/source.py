"""SGLang's own code and source facts, read from a release's wheel, for the stand-in and the contract tests.

Importing ``sglang`` needs its GPU stack (triton, a CUDA torchvision, ...), so the wheel is not installed: it is
fetched once with ``pip download --no-deps sglang==VERSION`` into ``$GRPO_ACCEL_SGLANG_SRC`` (default
``~/.cache/grpo_accel/sglang-src``) and these pieces are taken from its files:

- the group join: ``init_custom_process_group`` (srt/utils/common.py), executed as written;
- the routes: path, methods, auth level and request class of each endpoint, read from the decorators in
  srt/entrypoints/http_server.py;
- the request classes (srt/managers/io_struct.py), built from their source on SGLang's own base classes and
  validated by pydantic as FastAPI does (0.5.15+ with SGLang's msgspec-to-pydantic schema, srt/utils/msgspec_utils.py);
- the auth decision (srt/utils/auth.py, a module SGLang keeps importable without torch);
- the flattened-bucket layout (srt/weight_sync/tensor_bucket.py);
- 0.5.23's per-token weight versions (srt/utils/weight_versions.py, with its msgspec_utils import given);
- the /generate contract: sglang/api/v1/api_types.py (0.5.22+); before that the parameters of
  ``SamplingParams.__init__`` (srt/sampling/sampling_params.py);
- facts that live in code paths needing a GPU, read from the source (``facts.py``): the
  weight-update session guards (srt/managers/scheduler_components/weight_updater.py, 0.5.21+), the idle test of
  a memory release, when a health check is held back (srt/managers/scheduler.py) and how long /health waits, the
  context rule's comparison, what /server_info carries, and the model classes that
  implement ``get_weights_by_name`` (srt/models/).

Nothing here imports grpo_accel: the stand-in built on it must not share code with the client it tests.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import typing
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sglang_standin.facts import SourceFacts

VERSIONS = ("0.5.9", "0.5.23")  # the ends of the supported range, both run in the tests
FILES = (
    "sglang/_version.py",
    "sglang/srt/utils/common.py",
    "sglang/srt/utils/auth.py",
    "sglang/srt/utils/msgspec_utils.py",
    "sglang/srt/managers/io_struct.py",
    "sglang/srt/entrypoints/http_server.py",
    "sglang/srt/managers/scheduler_components/weight_updater.py",
    "sglang/srt/weight_sync/tensor_bucket.py",
    "sglang/srt/sampling/sampling_params.py",
    "sglang/api/v1/api_types.py",
    "sglang/srt/managers/tokenizer_manager.py",
    "sglang/srt/managers/scheduler_update_weights_mixin.py",  # 0.5.9: memory release and resume
    "sglang/srt/managers/scheduler.py",  # when a health check's generation is held back
    "sglang/srt/utils/weight_versions.py",  # 0.5.23: per-token weight versions
    "sglang/srt/arg_groups/parallel_hook.py",  # 0.5.23: --dp-size with --enable-dp-attention resolved
)


def source_dir(version: str) -> Path:
    """The unpacked files of sglang==version (FILES and srt/models/), downloaded on first use."""
    root = Path(os.environ.get("GRPO_ACCEL_SGLANG_SRC", Path.home() / ".cache" / "grpo_accel" / "sglang-src"))
    folder = root / version
    marker = folder / ".complete"
    if marker.exists() and marker.read_text() == "\n".join(FILES):  # an older cache may lack a file added since
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "-d", tmp, f"sglang=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("sglang-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"cannot fetch SGLang {version}'s source ({' '.join(cmd)}):\n{proc.stderr[-2000:]}\n"
                               "The SGLang contract tests read it from the wheel; with no package index, put the "
                               f"unpacked files under $GRPO_ACCEL_SGLANG_SRC/{version}/ and touch .complete there.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name in FILES or (name.startswith("sglang/srt/models/") and name.endswith(".py")):
                    wheel.extract(name, folder)
    marker.write_text("\n".join(FILES))
    return folder


@dataclass(frozen=True)
class Route:
    path: str
    methods: tuple[str, ...]
    auth_level: str  # "NORMAL" | "ADMIN_OPTIONAL" | "ADMIN_FORCE"
    request_class: str | None  # the io_struct class FastAPI validates the body against


class SGLangSource(SourceFacts):
    """One release's source; every property reads it once."""

    def __init__(self, version: str, root: Path | None = None) -> None:
        self.version = version
        self.root = root or source_dir(version)

    def text(self, rel: str) -> str:
        return (self.root / rel).read_text(encoding="utf-8-sig")

    def has(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def load_module(self, rel: str, imports: dict[str, types.ModuleType] | None = None) -> types.ModuleType:
        """Execute one file as a module of its own (no ``sglang`` package init, which needs the GPU stack);
        ``imports`` answers the file's own ``from sglang... import`` lines with modules loaded so."""
        name = f"sglang_src_{self.version.replace('.', '_')}_{Path(rel).stem}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, self.root / rel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        saved = {k: sys.modules.get(k) for k in imports or {}}
        sys.modules.update(imports or {})
        try:
            spec.loader.exec_module(module)
        finally:
            for key, old in saved.items():
                if old is None:
                    sys.modules.pop(key, None)
                else:
                    sys.modules[key] = old
        return module

    # -- code that runs here -----------------------------------------------------------------------------

    @functools.cached_property
    def init_custom_process_group(self):
        """srt/utils/common.py ``init_custom_process_group``, executed from its source."""
        import torch
        from packaging import version as pkg_version

        namespace = {"torch": torch, "torch_release": pkg_version.parse(torch.__version__).release}
        return _function_from_source(self.text("sglang/srt/utils/common.py"), "init_custom_process_group", namespace)

    @functools.cached_property
    def auth(self) -> types.ModuleType:
        """srt/utils/auth.py: ``decide_request_auth`` and ``AuthLevel``."""
        return self.load_module("sglang/srt/utils/auth.py")

    @functools.cached_property
    def FlattenedTensorBucket(self):  # noqa: N802 (SGLang's class)
        return self.load_module("sglang/srt/weight_sync/tensor_bucket.py").FlattenedTensorBucket

    @functools.cached_property
    def weight_versions(self) -> types.ModuleType | None:
        """srt/utils/weight_versions.py (0.5.23; None before): ``record_weight_version_events``,
        ``compute_weight_version_spans``, ``add_weight_versions_to_meta_info``."""
        rel = "sglang/srt/utils/weight_versions.py"
        if not self.has(rel):
            return None
        utils = self.load_module("sglang/srt/utils/msgspec_utils.py")
        return self.load_module(rel, imports={"sglang.srt.utils.msgspec_utils": utils})

    @functools.cached_property
    def routes(self) -> dict[str, Route]:
        """Every ``@app.<method>(path)`` endpoint of srt/entrypoints/http_server.py."""
        routes = {}
        for node in ast.walk(ast.parse(self.text("sglang/srt/entrypoints/http_server.py"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            paths, methods, level = [], [], "NORMAL"
            for deco in node.decorator_list:
                if not isinstance(deco, ast.Call):
                    continue
                func = deco.func
                if isinstance(func, ast.Attribute) and getattr(func.value, "id", None) == "app" and deco.args \
                        and isinstance(deco.args[0], ast.Constant):
                    paths.append(deco.args[0].value)
                    if func.attr == "api_route":
                        kw = {k.arg: k.value for k in deco.keywords}
                        methods += [e.value for e in kw["methods"].elts] if "methods" in kw else ["GET"]
                    else:
                        methods.append(func.attr.upper())
                elif getattr(func, "id", None) == "auth_level":
                    level = deco.args[0].attr
            body_class = next((_request_class(a.annotation) for a in node.args.args if a.annotation is not None
                               and _request_class(a.annotation)), None)
            for path in paths:
                routes[path] = Route(path, tuple(dict.fromkeys(methods)), level, body_class)
        return routes

    @functools.cached_property
    def _io_struct(self) -> tuple[types.ModuleType, dict[str, ast.ClassDef]]:
        """An empty module standing for io_struct.py, and the file's class statements by name."""
        source = self.text("sglang/srt/managers/io_struct.py")
        module = types.ModuleType(f"sglang_src_{self.version.replace('.', '_')}_io_struct")
        import abc
        import dataclasses
        import uuid

        module.__dict__.update({k: getattr(typing, k) for k in typing.__all__})
        module.__dict__.update(ABC=abc.ABC, dataclass=dataclasses.dataclass, field=dataclasses.field, uuid=uuid)
        if "msgspec" in source:
            import msgspec

            utils = self.load_module("sglang/srt/utils/msgspec_utils.py")
            module.__dict__.update(msgspec=msgspec, Base64Bytes=utils.Base64Bytes,
                                   msgspec_struct_pydantic_core_schema=utils.msgspec_struct_pydantic_core_schema)
        if self.weight_versions is not None:  # 0.5.23's AbortReq carries weight-version spans
            module.__dict__.update(WeightVersionSpans=self.weight_versions.WeightVersionSpans)
        tree = ast.parse(source)
        for node in tree.body:  # type aliases made of typing names (FinishReasonDict = Dict[...]); others skipped
            if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets) \
                    and isinstance(node.value, ast.Subscript):
                try:
                    exec(compile(ast.Module(body=[node], type_ignores=[]), "<io_struct alias>", "exec"), module.__dict__)
                except NameError:
                    pass
        sys.modules[module.__name__] = module
        return module, {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def request_class(self, name: str) -> type:
        """An io_struct.py request class, built from its source (and its bases') on SGLang's own base classes.

        Only those class statements run: the rest of the file imports the GPU stack."""
        module, classes = self._io_struct
        if name not in module.__dict__:
            for base in classes[name].bases:
                if isinstance(base, ast.Name) and base.id in classes:
                    self.request_class(base.id)
            code = ast.Module(body=[classes[name]], type_ignores=[])
            exec(compile(code, str(self.root / "sglang/srt/managers/io_struct.py"), "exec"), module.__dict__)
        return module.__dict__[name]

    def field_names(self, class_name: str) -> set[str]:
        """The fields of an io_struct.py class and its bases, read from the class statements."""
        _, classes = self._io_struct
        node = classes[class_name]
        names = {t.target.id for t in node.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)
                 and not ast.unparse(t.annotation).startswith("ClassVar")}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                names |= self.field_names(base.id)
        return names

    def validate(self, class_name: str, body: dict):
        """The request object FastAPI would build from ``body``; ``ValueError`` (HTTP 400) when it would not."""
        import pydantic

        try:
            return self._adapter(class_name).validate_python(body)
        except pydantic.ValidationError as exc:
            raise ValueError(str(exc)) from None

    @functools.lru_cache(None)  # noqa: B019 (one source object per release, alive for the whole process)
    def _adapter(self, class_name: str):
        import pydantic

        return pydantic.TypeAdapter(self.request_class(class_name))

    @functools.cached_property
    def _api_types(self) -> types.ModuleType | None:
        rel = "sglang/api/v1/api_types.py"
        return self.load_module(rel) if self.has(rel) else None

    def generate_contract_error(self, body: dict) -> str | None:
        """Why SGLang refuses a /generate body (HTTP 400), or None.

        0.5.22+: the generated contract, sglang/api/v1/api_types.py ``GenerateRequest.from_json_value``.
        Before: each sampling_params dict becomes ``SamplingParams(**params)`` (srt/sampling/sampling_params.py,
        in the tokenizer manager), so a key that is not one of its parameters fails."""
        if self._api_types is not None:
            try:
                self._api_types.GenerateRequest.from_json_value(body)
            except self._api_types.JsonContractError as exc:
                return str(exc)
            return None
        params = body.get("sampling_params") or {}
        for p in params if isinstance(params, list) else [params]:
            unknown = set(p) - self.sampling_param_names
            if unknown:
                return f"SamplingParams.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}"
        return None


def _request_class(annotation: ast.expr) -> str | None:
    """``Cls``, ``Annotated[Cls, Body()]`` or ``Annotated[Optional[Cls], Body()]`` -> "Cls" for *ReqInput classes."""
    text = ast.unparse(annotation)
    for token in text.replace("[", " ").replace("]", " ").replace(",", " ").split():
        if token.endswith(("ReqInput", "Req")) and token[0].isupper():
            return token
    return None


def _function_from_source(source: str, name: str, namespace: dict):
    """A module-level function of ``source``, compiled alone into ``namespace``."""
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"<sglang {name}>", "exec"), namespace)
    return namespace[name]
