"""Serve one reward of a config over HTTP, so that scoring can run on another machine (aiohttp).

    grpo-accel reward-server [--config FILE.yaml] --reward NAME [--host 0.0.0.0] [--port 8000] \
        [--api-key KEY] [key=value ...]     (or: python launch/reward_server.py ...)

``POST /score`` with JSON ``{"prompts": [...], "completions": [...], "fields": {column: [...]}}`` answers
``{"rewards": [one float per completion]}``: the protocol of the trainer's ``remote`` reward
(``rewards: [{name: remote, url: http://HOST:PORT/score}]``). ``NAME`` is any entry of the config's ``rewards``
(a built-in or ``module:function``, a ``reward_model``, with its kwargs, worker processes and time limit); its
values come back unweighted and unnormalised (the trainer weighs them). ``GET /health`` answers 200. A failing
function is a 500 with its message; a body that is not that protocol a 400.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from grpo_accel.cli.text import command_parser

sys.path.insert(1, str(Path.cwd()))  # reward functions named `module:function` may live where it starts

log = logging.getLogger("grpo_accel.reward_server")


def make_app(fn, api_key: str | None = None):
    """The aiohttp application serving reward function ``fn``; with ``api_key``, a request without that bearer
    token is a 401 (compared in constant time: how much of a guess matched does not show in the answer's time)."""
    import hmac

    from aiohttp import web

    from grpo_accel.rewards import call_reward, is_async_reward

    expected = f"Bearer {api_key}".encode() if api_key else None

    async def score(request: web.Request) -> web.Response:
        if expected is not None and not hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                                            expected):
            return web.json_response({"error": "Unauthorized"}, status=401)
        try:
            body = await request.json()
            prompts, completions, fields = body["prompts"], body["completions"], body.get("fields") or {}
            if not (isinstance(prompts, list) and isinstance(completions, list) and len(prompts) == len(completions)):
                raise ValueError("prompts and completions must be lists of one length")
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"not a scoring request: {exc}"}, status=400)
        try:
            arguments = {"prompts": prompts, "completions": completions, **fields}
            if is_async_reward(fn):
                values = await call_reward(fn, arguments)
            else:  # a blocking function runs beside the event loop, which keeps answering
                values = await asyncio.to_thread(lambda: list(call_reward(fn, arguments)))
            return web.json_response({"rewards": [None if v is None else float(v) for v in values]})
        except Exception as exc:  # noqa: BLE001 - the trainer gets the message
            log.exception("scoring failed")
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=256 * 2**20)
    app.add_routes([web.post("/score", score), web.get("/health", health)])
    return app


def loopback(host: str) -> bool:
    """``host`` is reached from this machine only (localhost, 127.0.0.0/8, ::1)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def main(argv: list[str] | None = None) -> int:
    parser = command_parser(__doc__)
    parser.add_argument("--config", help="the training config whose rewards entry to serve (default: the built-in)")
    parser.add_argument("--reward", required=True, help="the name of that entry, e.g. answer_match or mymod:fn")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", help="then every request must carry 'Authorization: Bearer KEY'")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config, e.g. rewards=[...]")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from aiohttp import web

    from grpo_accel.config.checks import ConfigError
    from grpo_accel.config.loading import load_config
    from grpo_accel.recipe.parts import build_reward

    try:
        cfg = load_config(args.config, args.overrides)
        entries = {c.name: c for c in cfg.rewards}
        if args.reward not in entries:
            raise ConfigError(f"--reward {args.reward!r}: the config's rewards are {sorted(entries)}; name one.")
        fn = build_reward(entries[args.reward])
    except ConfigError as err:
        parser.exit(2, f"error: {err}\n")
    log.info("serving reward %r at http://%s:%d/score", args.reward, args.host, args.port)
    if not args.api_key and not loopback(args.host):
        log.warning("--host %s serves beyond this machine without --api-key: anyone who reaches port %d can ask for "
                    "scores; start it with --api-key KEY (the trainer's rewards[].api_key)", args.host, args.port)
    web.run_app(make_app(fn, args.api_key), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
