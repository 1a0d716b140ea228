"""A Ray Serve application of N kvserve replicas behind Ray Serve's router, on one machine or a Ray cluster's nodes
(the optional extra kvserve[ray]; docs/SCALING.md).

    python -m kvserve.serve_ray --num-replicas 2 --model MODEL [--host H --port P] [any `kvserve serve` flag]
    serve run kvserve.serve_ray:build_app model=MODEL num_replicas=2 [flag=value ...]   (Ray Serve's CLI)

Each replica is a Ray actor running the whole `kvserve serve` app (its engine in a child process, as usual, or
N engines with --data-parallel-size), with Ray Serve's HTTP proxy in front: the same OpenAI endpoints, one port
per node. Ray Serve health-checks each replica through the engine (a replica whose engine died is restarted)
and routes each request to the less loaded of two replicas it samples. `python -m` joins a running cluster
(RAY_ADDRESS, or `ray start` on this machine) or starts a local Ray instance, and ends on SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

logger = logging.getLogger("kvserve.server")

_OWN_FLAGS = ("num_replicas", "num_cpus_per_replica", "num_gpus_per_replica")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.server.cli import add_arguments as add_serve_arguments

    parser.add_argument("--num-replicas", type=int, default=1, help="kvserve replicas (Ray Serve's num_replicas)")
    parser.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                        help="CPUs Ray reserves for each replica (its actor's num_cpus)")
    parser.add_argument("--num-gpus-per-replica", type=float, default=0.0,
                        help="GPUs Ray reserves for each replica (its actor's num_gpus)")
    add_serve_arguments(parser)


def _parser() -> argparse.ArgumentParser:
    from kvserve.utils.cli_help import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(prog="python -m kvserve.serve_ray", formatter_class=DefaultsHelpFormatter,
                                     description="kvserve replicas as a Ray Serve application")
    add_arguments(parser)
    return parser


def _argv(args: dict | list | argparse.Namespace | None) -> list[str]:
    """`serve run`'s key=value arguments (strings; "true" for a flag without a value) as command-line flags."""
    if args is None:
        return []
    if isinstance(args, list):
        return [str(a) for a in args]
    items = vars(args).items() if isinstance(args, argparse.Namespace) else args.items()
    argv = []
    for key, value in items:
        flag = "--" + str(key).replace("_", "-")
        if value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is False or str(value).lower() == "false":
            argv.append("--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def build_app(args: dict | list | argparse.Namespace | None = None):
    """The Ray Serve application (bind()-ed deployment) for these `kvserve serve` flags plus --num-replicas,
    --num-cpus-per-replica and --num-gpus-per-replica. Bad flags raise ValueError here, before any replica starts."""
    try:
        from ray import serve
    except ImportError as e:
        raise ValueError("kvserve.serve_ray needs Ray Serve: pip install 'kvserve[ray]'") from e
    argv = _argv(args)
    parsed = _parser().parse_args(argv)
    if parsed.num_replicas < 1:
        raise ValueError(f"--num-replicas must be >= 1, got {parsed.num_replicas}")
    replica_argv = _strip_own(argv)
    _replica_configs(replica_argv)  # every engine and server flag checked now

    def build_asgi_app():  # NOTE: a plain function: Ray Serve calls it in each replica, not here
        return _replica_app(replica_argv)

    deployment = serve.deployment(
        serve.ingress(build_asgi_app)(KVServeReplica), name="kvserve", num_replicas=parsed.num_replicas,
        ray_actor_options={"num_cpus": parsed.num_cpus_per_replica, "num_gpus": parsed.num_gpus_per_replica,
                           "runtime_env": {"env_vars": _replica_env()}},
        health_check_period_s=5, health_check_timeout_s=30)
    return deployment.bind()


class KVServeReplica:
    """One replica: Ray Serve's ingress wrapper holds the kvserve app (`self.app`) and runs its lifespan."""

    async def check_health(self) -> None:
        state = getattr(self.app.state, "kvserve", None)
        if state is not None and not state.engine.is_running:
            raise RuntimeError(f"the engine is not running: {state.engine.dead_reason}")


def _strip_own(argv: list[str]) -> list[str]:
    """argv without this module's own flags (and their values)."""
    own = {"--" + name.replace("_", "-") for name in _OWN_FLAGS}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in own:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _replica_configs(argv: list[str]):
    from kvserve.config import EngineArgs
    from kvserve.server.cli import add_arguments as add_serve_arguments
    from kvserve.server.config import ServerConfig

    parser = argparse.ArgumentParser(prog="kvserve serve")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    return ServerConfig.from_cli(args), EngineArgs.from_cli(args)


def _replica_app(argv: list[str]):
    from kvserve.server.api_server import build_app as build_server_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, engine_args = _replica_configs(argv)
    return build_server_app(config, engine_args)


def _replica_env() -> dict[str, str]:
    """This checkout first on each replica's path (a node without it keeps its own install)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": root + (os.pathsep + rest if rest else "")}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parsed = _parser().parse_args(argv)
    try:
        app = build_app(list(argv) if argv is not None else sys.argv[1:])
    except ValueError as e:
        print(f"kvserve.serve_ray: error: {e}", flush=True)
        return 2
    import ray
    from ray import serve

    from kvserve.engine.ray_engine import connect_ray

    started = connect_ray(int(parsed.num_replicas * parsed.num_cpus_per_replica + 0.999))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": parsed.host, "port": parsed.port})
        serve.run(app, name="kvserve", route_prefix="/", blocking=False)
        replicas = serve.status().applications["kvserve"].deployments["kvserve"].replica_states
        logger.info("Ray Serve: %s", ", ".join(f"{n} replica(s) {s}" for s, n in replicas.items()))
        print(f"kvserve: serving on http://{parsed.host}:{parsed.port} (Ray Serve, {parsed.num_replicas} replicas)",
              flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
