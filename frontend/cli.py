"""`deepinfer` command: `serve`, `generate`, `prepare-model`, `bench serve`, `bench sweep`.

A problem the user can fix (no such model, a model the engine cannot run, an engine that cannot
start) is printed as one line, `deepinfer: error: ...`, with exit code 1: no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import typing

from deepinfer.engine import envs, model_store
from deepinfer.engine.config import DEFAULT_MODEL_NAME, EngineConfig, ModelConfigError
from deepinfer.engine.runtime.launcher import EngineStartupError
from deepinfer.engine.settings import flag, settings
from deepinfer.frontend.auth import resolve_api_key
from deepinfer.frontend.router.policy import POLICIES
from deepinfer.frontend.server.origin_checks import OriginPolicy
from deepinfer.frontend.server.parsers.reasoning.registry import REASONING_PARSERS
from deepinfer.frontend.server.parsers.tool_calls.registry import TOOL_CALL_PARSERS

_SECRET_HELP = ("a file holding the secret DeepInfer's servers, PD router and nodes share to "
                "authenticate each other (default: DEEPINFER_CLUSTER_SECRET); needed with "
                "--disaggregation-mode, --nnodes > 1 and the PD router")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every engine setting as a flag, from its declaration (engine/config.py); unset flags
    keep EngineConfig's defaults."""
    p.add_argument("--model", default="default",
                   help=f"HF model directory, or a named model prepared on first use: "
                        f"{', '.join(model_store.RECIPES)} ('default' is {DEFAULT_MODEL_NAME})")
    for name, (kind, decl) in settings(EngineConfig).items():
        if kind is bool:  # a switch: --x / --no-x
            p.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=None,
                           help=decl.description)
        elif typing.get_origin(kind) is list:  # several values: --x A B
            p.add_argument(flag(name), nargs="+", default=None, help=decl.description)
        else:  # argparse checks the choices: a typo is refused before anything starts
            p.add_argument(flag(name), type=kind, default=None, help=decl.description,
                           choices=decl.extra["choices"] or None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags the user set, as EngineConfig keyword arguments."""
    return {n: getattr(args, n) for n in settings(EngineConfig) if getattr(args, n) is not None}


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(model=args.model, **(engine_kwargs(args) | overrides))


def _replica_args(args: argparse.Namespace, model: str,
                  skip: tuple[str, ...] = ("worker_threads",)) -> list[str]:
    """`deepinfer serve` flags for one local server behind the router: the engine's as given,
    but those in `skip`, which the topology sets per server."""
    out = ["--model", model, "--max-pending", str(args.max_pending), "--max-buffered-outputs",
           str(args.max_buffered_outputs), "--log-level", args.log_level]
    if args.reasoning_parser:
        out += ["--reasoning-parser", args.reasoning_parser]
    if args.tool_call_parser:
        out += ["--tool-call-parser", args.tool_call_parser]
    for name, value in engine_kwargs(args).items():
        if name in skip:
            continue
        if isinstance(value, bool):  # a switch
            out.append(flag(name) if value else "--no-" + flag(name)[2:])
        elif isinstance(value, list):
            out += [flag(name), *value]
        else:
            out += [flag(name), str(value)]
    return out


def _serve(args: argparse.Namespace) -> int:
    from deepinfer.frontend.server.server import serve

    disaggregated = bool(args.prefill_servers)
    if disaggregated and envs.cluster_secret() is None:
        # Local servers and their router only: a fresh secret they inherit, no one else knows.
        os.environ["DEEPINFER_CLUSTER_SECRET"] = secrets.token_hex(32)
    # Checked as the local servers will run: each with a role (it needs the prefix cache).
    overrides = {"disaggregation_mode": "prefill"} if disaggregated else {}
    config = model_store.ensure_config(engine_config(args, **overrides))
    if config.node_rank > 0:  # this node only runs worker ranks
        from deepinfer.engine.runtime.worker_node import run_worker_node

        return run_worker_node(config)
    if args.data_parallel_size > 1:
        from deepinfer.frontend.router.kv_events import port_clash
        from deepinfer.frontend.router.policy import Policy
        from deepinfer.frontend.router.server import serve_data_parallel

        events = config.kv_events()  # rank 0's; replica i's ports are these plus i
        clash = port_clash(events, args.data_parallel_size) if events is not None else None
        if clash:
            raise ModelConfigError(clash)
        return serve_data_parallel(
            _replica_args(args, config.model, ("worker_threads", "data_parallel_rank")),
            args.data_parallel_size, args.host, args.port, Policy(args.policy),
            config.worker_threads, resolve_api_key(args.api_key),
            kv_events=(events, config.resolved_model_dir()) if events is not None else None,
            origins=_browser_policy(args))
    if disaggregated:
        from deepinfer.frontend.router.policy import Policy
        from deepinfer.frontend.router.server import serve_disaggregated

        server_args = _replica_args(args, config.model, ("worker_threads", "disaggregation_mode"))
        return serve_disaggregated(server_args, args.prefill_servers, args.decode_servers,
                                   args.host, args.port, Policy(args.policy),
                                   config.worker_threads, resolve_api_key(args.api_key),
                                   origins=_browser_policy(args))
    return serve(config, args.host, args.port, args.max_pending, args.log_level,
                 args.access_log, resolve_api_key(args.api_key), args.shutdown_timeout,
                 args.max_buffered_outputs, args.reasoning_parser, args.tool_call_parser,
                 ui=not args.no_ui, allowed_hosts=args.allowed_hosts,
                 allowed_origins=args.allowed_origins)


def _add_browser_flags(parser: argparse.ArgumentParser) -> None:
    """--allowed-hosts and --allowed-origins (frontend/server/origin_checks.py), for servers and
    routers alike."""
    parser.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                        help="Host names served besides loopback ones and --host (a guard "
                             "against DNS rebinding; '.example.com': it and its subdomains; "
                             "'*': any). Bound to a non-loopback address, any name is served "
                             "unless this is given")
    parser.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="web origins (https://app.example.com) whose pages may call this "
                             "server from a browser (CORS; '*': any); default: only the "
                             "server's own page")


def _browser_policy(args: argparse.Namespace) -> OriginPolicy:
    return OriginPolicy.create(args.host, args.allowed_hosts, args.allowed_origins)


def _router(args: argparse.Namespace) -> int:
    from deepinfer.frontend.router.policy import Policy
    from deepinfer.frontend.router.server import run_pd_router, run_router

    policy = Policy(args.policy, args.cache_threshold, args.balance_abs_threshold)
    if args.prefill:
        return run_pd_router(args.prefill, args.decode, args.host, args.port, policy,
                             args.health_interval, args.log_level, resolve_api_key(args.api_key),
                             _browser_policy(args))
    kv_events = None
    if args.kv_events:
        events = EngineConfig(kv_events_config=args.kv_events).kv_events()  # checked alike
        if events is None:
            raise ModelConfigError("router: --kv-events must enable events "
                                   '("enable_kv_cache_events": true)')
        model = EngineConfig(model=model_store.ensure_model(args.tokenizer))
        kv_events = (events, model.resolved_model_dir())
    return run_router(args.worker, args.host, args.port, policy, args.health_interval,
                      args.log_level, resolve_api_key(args.api_key), kv_events,
                      _browser_policy(args))


def usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of flags that argparse cannot see alone (None: all
    is well); checked before anything starts."""
    if args.command == "router":
        dp, prefill, decode = args.worker or [], args.prefill or [], args.decode or []
        if dp and (prefill or decode):
            return ("router: --worker (data parallel) and --prefill/--decode (prefill/decode "
                    "disaggregation) are two modes: choose one")
        if not (dp or prefill or decode):
            return ("router: give --worker URL for each replica, or --prefill URL and --decode "
                    "URL for each prefill and decode server")
        if bool(prefill) != bool(decode):
            return "router: --prefill and --decode go together: a request needs one of each"
        if {u.rstrip("/") for u in prefill} & {u.rstrip("/") for u in decode}:
            return "router: a server is either a --prefill or a --decode server, not both"
        if args.kv_events and not args.tokenizer:
            return ("router: --kv-events needs --tokenizer MODEL (requests are matched to "
                    "cached blocks by their tokens)")
        if args.kv_events and prefill:
            return "router: --kv-events places data-parallel replicas (--worker), not --prefill"
        if prefill and envs.cluster_secret() is None:
            return ("router: --prefill/--decode need the cluster secret its servers have: set "
                    "DEEPINFER_CLUSTER_SECRET, or --cluster-secret-file FILE")
    if args.command == "serve":
        prefill, decode = args.prefill_servers, args.decode_servers
        if min(prefill, decode) < 0:
            return "--prefill-servers and --decode-servers must not be negative"
        if (prefill or decode) and not (prefill and decode):
            return ("--prefill-servers and --decode-servers go together: at least 1 of each "
                    "(a request needs both)")
        if (prefill or decode) and args.data_parallel_size > 1:
            return ("--prefill-servers/--decode-servers and --data-parallel-size are two "
                    "topologies: choose one")
    return None


def _generate(args: argparse.Namespace) -> int:
    from deepinfer.engine.protocol import SamplingParams
    from deepinfer.engine.runtime.llm import LLM
    from deepinfer.engine.tokenizer.tokenizer import Tokenizer

    config = model_store.ensure_config(engine_config(args))
    chat = args.chat
    if chat is None:
        chat = Tokenizer(config.resolved_model_dir()).chat_template is not None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed)
    llm = LLM(config.model, **engine_kwargs(args))
    try:
        if chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            out = llm.generate([args.prompt], params)[0]
    finally:
        llm.shutdown()
    print(out.text)
    return 0


def _prepare_model(args: argparse.Namespace) -> int:
    print(model_store.prepare(args.name, force=args.force))
    return 0


def _bench_sweep(args: argparse.Namespace) -> int:
    from deepinfer.frontend.bench import serving as bench_serving

    return bench_serving.sweep(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from deepinfer.frontend.bench import serving as bench_serving

    return bench_serving.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-pending", type=int, default=256,
                       help="engine requests in flight before new ones get 503")
    serve.add_argument("--max-buffered-outputs", type=int, default=4096,
                       help="outputs a stream may hold for a client that reads slower than the "
                            "engine writes; past it the request is aborted (default 4096)")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split reasoning models' <think> output into reasoning_content: "
                            "deepseek_r1, qwen3, deepseek_v3 (V3.1/V4 thinking mode)")
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                       help="how the model writes tool calls (default: the format its chat "
                            "template shows, else hermes: <tool_call> JSON blocks)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM's scripts: tool_choice auto is always on")
    serve.add_argument("--access-log", action="store_true")
    serve.add_argument("--no-ui", action="store_true",
                       help="do not serve the browser page (chat and server view) at /")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every /v1 route (or "
                            "`x-api-key: KEY` on /v1/messages, as Anthropic's clients send it; "
                            "default: $DEEPINFER_API_KEY; unset: open)")
    serve.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                       help=_SECRET_HELP)
    _add_browser_flags(serve)
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT: seconds requests in flight may take to finish "
                            "while new ones get 503 (default 30; 0: stop at once)")
    serve.add_argument("--data-parallel-size", type=int, default=1,
                       help="replicas of the whole engine, each on its own local port, behind "
                            "a router on --port (default 1: no router)")
    serve.add_argument("--prefill-servers", type=int, default=0, metavar="N",
                       help="prefill/decode disaggregation on this machine: N prefill servers "
                            "and --decode-servers M decode servers, each on its own local port, "
                            "behind a router on --port (default 0: off)")
    serve.add_argument("--decode-servers", type=int, default=0, metavar="M",
                       help="with --prefill-servers: the decode servers (default 0)")
    serve.add_argument("--policy", choices=POLICIES, default="cache_aware",
                       help="with --data-parallel-size: how the router places requests (with "
                            "--prefill-servers: on the prefill servers)")
    serve.set_defaults(func=_serve)

    router = sub.add_parser("router", help="route requests over running `deepinfer serve` "
                                           "replicas (data parallelism), or over prefill and "
                                           "decode servers (disaggregation)")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--worker", action="append", metavar="URL",
                        help="a replica's base URL (http://host:port); repeat for each")
    router.add_argument("--prefill", action="append", metavar="URL",
                        help="instead of --worker: a prefill server's base URL (`deepinfer serve "
                             "--disaggregation-mode prefill`); repeat for each; needs --decode")
    router.add_argument("--decode", action="append", metavar="URL",
                        help="a decode server's base URL (`--disaggregation-mode decode`); "
                             "repeat for each; requests go to the least loaded")
    router.add_argument("--policy", choices=POLICIES, default="cache_aware",
                        help="cache_aware (default): the replica holding the longest cached "
                             "prefix unless the load is out of balance; round_robin; least_load "
                             "(with --prefill: how prefill servers are chosen)")
    router.add_argument("--cache-threshold", type=float, default=0.5,
                        help="cache_aware: the share of the prompt a replica's cached prefix "
                             "must cover to win (default 0.5)")
    router.add_argument("--balance-abs-threshold", type=int, default=8,
                        help="cache_aware: in-flight requests between the busiest and the "
                             "idlest replica past which the idlest gets the request (default 8)")
    router.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every /v1 route (or "
                             "`x-api-key: KEY` on /v1/messages) and pass it to the replicas "
                             "(default: $DEEPINFER_API_KEY)")
    router.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                        help=_SECRET_HELP)
    _add_browser_flags(router)
    router.add_argument("--kv-events", default=None, metavar="CONFIG",
                        help="place requests by the replicas' KV cache events: the JSON the "
                             "replicas were given as --kv-events-config (the i-th --worker "
                             "publishes on its ports plus i, at its URL's host); needs "
                             "--tokenizer")
    router.add_argument("--tokenizer", default=None, metavar="MODEL",
                        help="with --kv-events: the replicas' model (a directory or a named "
                             "model) whose tokenizer and chat template turn requests into "
                             "tokens")
    router.add_argument("--health-interval", type=float, default=1.0,
                        help="seconds between health checks of each replica")
    router.add_argument("--log-level", default="info")
    router.set_defaults(func=_router)

    gen = sub.add_parser("generate", help="generate once, offline, and print the text")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap the prompt in the chat template (default: if the model has one)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.set_defaults(func=_generate)

    prep = sub.add_parser("prepare-model", help="download and convert a named model, once")
    prep.add_argument("name", nargs="?", default="default",
                      help=f"one of: {', '.join(model_store.RECIPES)} ('default' is "
                           f"{DEFAULT_MODEL_NAME}); written under $DEEPINFER_CACHE "
                           f"(default ~/.cache/deepinfer)")
    prep.add_argument("--force", action="store_true", help="prepare again even if present")
    prep.set_defaults(func=_prepare_model)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    from deepinfer.frontend.bench.serving import add_arguments

    add_arguments(bench_serve)
    bench_serve.set_defaults(func=_bench_serve)
    bench_sweep = bench_sub.add_parser(
        "sweep", help="load-test an OpenAI-compatible server at several concurrency levels: "
                      "throughput against TTFT / ITL, one JSON and one plot")
    from deepinfer.frontend.bench.serving import add_sweep_arguments

    add_sweep_arguments(bench_sweep)
    bench_sweep.set_defaults(func=_bench_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "cluster_secret_file", None):
        try:
            with open(args.cluster_secret_file) as f:
                secret = f.read().strip()
        except OSError as e:
            parser.error(f"--cluster-secret-file: {e}")
        if not secret:
            parser.error(f"--cluster-secret-file: {args.cluster_secret_file} is empty")
        # The processes this command starts inherit it (never on a command line: ps shows those).
        os.environ["DEEPINFER_CLUSTER_SECRET"] = secret
    problem = usage_problem(args)
    if problem:
        parser.error(problem)  # `deepinfer: error: ...`, exit code 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ModelConfigError, EngineStartupError) as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return 1
