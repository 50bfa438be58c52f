"""Run by the vLLM venv's Python (it imports ``vllm``, which the trainer's venv lacks): checks request bodies, given
as JSON ``[[path, body], ...]`` in the file named by argv[1], against vLLM's own route definitions and request
classes. Prints a JSON list of what does not match (empty: all do).

- ``/v1/completions``: the body validates as ``CompletionRequest`` and names only its fields (vLLM accepts and
  only logs unknown ones, so a misspelt key would be ignored without a word).
- Routes built by FastAPI from their signature (``/pause``, ``/sleep``, ``/resume``, ``/update_weight_version``):
  every query parameter and body key is one the route declares, literal choices included, and every body
  parameter it requires is given.
- Routes that read the raw JSON (``/abort_requests``, ``/collective_rpc``): every key is one its source reads;
  for ``reload_weights``, every keyword is a parameter of the model runner's method.
"""
import inspect
import json
import sys
import typing
from urllib.parse import parse_qsl, urlsplit


def routes() -> dict:
    from vllm.entrypoints.rl.online import api_router as rl
    from vllm.entrypoints.serve.dev.rpc import api_router as rpc
    from vllm.entrypoints.serve.dev.sleep import api_router as sleep

    return {route.path: route for module in (rl, rpc, sleep) for route in module.router.routes}


def check_completion(body: dict) -> list[str]:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    problems = [f"/v1/completions: {key} is not a CompletionRequest field" for key in body
                if key not in CompletionRequest.model_fields]
    try:
        CompletionRequest.model_validate(body)
    except Exception as exc:  # pydantic's ValidationError
        problems.append(f"/v1/completions: {exc}")
    return problems


def check_declared(route, query: dict, body: dict) -> list[str]:
    problems = []
    params = {p.name: p for p in route.dependant.query_params}
    for key, value in query.items():
        if key not in params:
            problems.append(f"{route.path}: query parameter {key} is not declared")
            continue
        choices = typing.get_args(params[key].field_info.annotation)
        if choices and all(isinstance(c, str) for c in choices) and value not in choices:
            problems.append(f"{route.path}: {key}={value} is not one of {choices}")
    declared = {p.name: p for p in route.dependant.body_params}
    problems += [f"{route.path}: body key {key} is not declared" for key in body if key not in declared]
    problems += [f"{route.path}: body key {name} is required" for name, p in declared.items()
                 if p.field_info.is_required() and name not in body]
    return problems


def check_raw(route, body: dict) -> list[str]:
    source = inspect.getsource(route.endpoint)
    problems = [f"{route.path}: its source never reads {key!r}" for key in body if f'body.get("{key}"' not in source]
    if route.path == "/collective_rpc" and body.get("method") == "reload_weights":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        accepted = inspect.signature(GPUModelRunner.reload_weights).parameters
        problems += [f"reload_weights takes no {key}" for key in body.get("kwargs", {}) if key not in accepted]
    return problems


def main(path: str) -> list[str]:
    known, problems = routes(), []
    for target, body in json.loads(open(path).read()):
        url = urlsplit(target)
        query = dict(parse_qsl(url.query))
        if url.path == "/v1/completions":
            problems += check_completion(body)
        elif url.path not in known:
            problems.append(f"{url.path}: no such route")
        elif known[url.path].dependant.query_params or known[url.path].dependant.body_params or not body:
            problems += check_declared(known[url.path], query, body)
        else:
            problems += check_raw(known[url.path], body)
    return problems


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
