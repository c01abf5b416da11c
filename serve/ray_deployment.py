"""paged-serve replicas under Ray Serve: N engines over one compiled artifact + weight pack.

The application is two deployments.  :class:`Ingress` (one light replica behind Ray's HTTP
proxy) reads each request's body, takes the prompt text the router matches on
(serve/ray_router.py) and hands the request to an :class:`EngineReplica` through a deployment
handle; each ``EngineReplica`` holds one ``BatchEngine`` with its own KV pool and runs the very
app ``paged-serve`` runs (serve/app.py ``create_app``) on the forwarded request, so the routes,
errors and metrics are the same.  Prefix affinity needs the body before a replica is chosen,
which Ray's proxy does not read: hence the ingress hop.

Every response carries ``x-paged-replica: <id>``; a request sending that header is served by
that replica (``GET /health`` and ``GET /metrics`` per replica), or gets 404 when it is gone.
Ray calls :meth:`EngineReplica.check_health` every ``health_check_period_s``: a replica whose
engine thread has stopped fails it, leaves the routing table and is replaced.  A replica that
dies before a response's first token was sent has the request sent again to another replica
(``retries`` times); after that the response ends with a 5xx, or, for a stream already
started, with an error event and no ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from dataclasses import dataclass, field

from ray import serve

from .ray_router import REPLICA_HEADER, Forwarded, routing_key
from .ray_http import call_app

log = logging.getLogger(__name__)

APP_NAME = "paged-decode"
ROUTER = "paged_decode.serve.ray_router.PrefixAffinityRouter"


@dataclass(frozen=True)
class RayServeConfig:
    """What every replica loads and how the application is laid out (paged-serve's options,
    plus the replica count and the router's)."""

    artifact_dir: str
    weights_dir: str
    model_name: str | tuple[str, ...]
    replicas: int = 2
    kv_cache_gb: float | None = None
    max_running: int | None = None
    max_waiting: int = 64
    prefill_budget: int = 512
    chat_template: str | None = None  # the template's source, read_chat_template checked it
    api_key: str | None = None
    tool_parser: str | None = None
    allowed_origins: tuple[str, ...] | None = None
    speculative: object | None = None  # a SpeculativeConfig: every replica drafts alike
    replica_cpus: float | None = None  # None: this machine's cores shared by the replicas
    replica_resources: dict = field(default_factory=dict)  # Ray custom resources, e.g. a CPU kind
    prefix_routing: bool = True  # False: Ray's default router (power of two choices)
    chunk_chars: int = 64  # the router's prefix unit (about 16 tokens of English)
    imbalance: int = 8  # queue-length gap past which affinity yields to the least loaded
    retries: int = 1
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    router_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        from paged_decode.runtime.errors import ConfigError

        for name in ("replicas", "chunk_chars"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)!r}, expected a whole number "
                                  ">= 1")
        if self.retries < 0 or self.imbalance < 0:
            raise ConfigError(f"retries {self.retries}, imbalance {self.imbalance}: expected "
                              "whole numbers >= 0")


class ReplicaCore:
    """One engine and its app; what an :class:`EngineReplica` does, without Ray."""

    def __init__(self, cfg: RayServeConfig, replica_id: str):
        from pathlib import Path

        from . import load_engine
        from .app import create_app

        self.id = replica_id
        self.engine = load_engine(Path(cfg.artifact_dir), Path(cfg.weights_dir),
                                  kv_cache_gb=cfg.kv_cache_gb, max_running=cfg.max_running,
                                  max_waiting=cfg.max_waiting,
                                  prefill_budget=cfg.prefill_budget,
                                  chat_template=cfg.chat_template,
                                  speculative=cfg.speculative)
        names = [cfg.model_name] if isinstance(cfg.model_name, str) else list(cfg.model_name)
        origins = None if cfg.allowed_origins is None else list(cfg.allowed_origins)
        self.app = create_app(self.engine, names, api_key=cfg.api_key,
                              tool_parser=cfg.tool_parser, allowed_origins=origins)
        self.app.state.server.probe_structured_output()  # the lifespan's start-up step

    def check_health(self) -> None:
        """Raise when the engine can serve no more (its thread stopped)."""
        from paged_decode.runtime.errors import EngineStoppedError

        if not self.engine.alive:
            raise EngineStoppedError(f"replica {self.id}: the engine's thread has stopped")

    async def handle(self, req: Forwarded):
        """The app's answer to ``req``: ("start", status, headers), then body chunks."""
        if req.pin is not None and req.pin != self.id:
            yield _json_start(404, self.id)
            yield _error_body(404, f"replica {req.pin} is not running (this is {self.id}); "
                              f"drop the {REPLICA_HEADER} header or pick a running replica")
            return
        async for msg in call_app(self.app, req, [(REPLICA_HEADER.encode(),
                                                   self.id.encode())]):
            yield msg

    def close(self) -> None:
        self.engine.close()


class EngineReplica:
    """A Ray Serve replica: :class:`ReplicaCore` with Ray's health check and shutdown."""

    def __init__(self, cfg: RayServeConfig):
        # TVM's pool would start one thread per core of the machine in every replica
        os.environ["TVM_NUM_THREADS"] = str(max(1, int(replica_cpus(cfg))))
        self.core = ReplicaCore(cfg, serve.get_replica_context().replica_id.unique_id)

    def check_health(self) -> None:
        self.core.check_health()

    async def handle(self, req: Forwarded):
        async for msg in self.core.handle(req):
            yield msg

    def __del__(self):
        core = getattr(self, "core", None)
        if core is not None:
            core.close()


class Ingress:
    """Ray's proxy sends every request here; it goes on to an :class:`EngineReplica`."""

    def __init__(self, replica, retries: int):
        self.replica, self.retries = replica, retries

    async def __call__(self, request):
        from .ray_http import forward

        return await forward(self.replica, request, self.retries)


def build_application(cfg: RayServeConfig):
    """The Ray Serve application (``serve.run(build_application(cfg))``)."""
    from ray.serve.config import RequestRouterConfig

    router = RequestRouterConfig()  # Ray's default: power of two choices
    if cfg.prefix_routing:
        router = RequestRouterConfig(
            request_router_class=ROUTER,
            request_router_kwargs={"chunk_chars": cfg.chunk_chars, "imbalance": cfg.imbalance,
                                   **cfg.router_kwargs})
    replica = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=cfg.replicas,
        ray_actor_options={"num_cpus": replica_cpus(cfg),
                           "resources": dict(cfg.replica_resources)},
        max_ongoing_requests=_capacity(cfg), request_router_config=router,
        health_check_period_s=cfg.health_check_period_s,
        health_check_timeout_s=cfg.health_check_timeout_s)
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4096)
    return ingress.bind(replica.bind(cfg), cfg.retries)


def app_builder(args: dict):
    """The application from ``serve run`` arguments or a Serve config file's ``args``
    (``artifact_dir``, ``weights_dir``, ``model_name`` and any :class:`RayServeConfig` field;
    strings are converted to the field's type; ``chat_template`` names a file)."""
    import dataclasses

    from paged_decode.runtime.errors import ConfigError

    fields = {f.name: f for f in dataclasses.fields(RayServeConfig)}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ConfigError(f"unknown Ray Serve argument(s) {unknown}: expected some of "
                          f"{sorted(fields)}")
    try:
        values = {k: _typed(fields[k].type, v) for k, v in args.items()}
        if values.get("chat_template") is not None:  # a file here, as paged-serve's option
            from . import read_chat_template

            values["chat_template"] = read_chat_template(values["chat_template"])
        return build_application(RayServeConfig(**values))
    except TypeError as e:
        raise ConfigError(f"Ray Serve arguments: {e} (artifact_dir, weights_dir and "
                          "model_name are required)") from e


def _typed(kind: str, value):
    if not isinstance(value, str):
        return value
    if value.lower() == "none" and "None" in kind:
        return None
    if kind == "bool":
        if value.lower() not in ("true", "false"):
            from paged_decode.runtime.errors import ConfigError

            raise ConfigError(f"Ray Serve argument {value!r}: not true or false")
        return value.lower() == "true"
    for name, cast in (("int", int), ("float", float)):
        if kind.startswith(name):
            try:
                return cast(value)
            except ValueError as e:
                from paged_decode.runtime.errors import ConfigError

                raise ConfigError(f"Ray Serve argument {value!r}: not {kind}") from e
    return value


def replica_cpus(cfg: RayServeConfig) -> float:
    """The CPUs Ray reserves for each replica (and its TVM threads)."""
    if cfg.replica_cpus is not None:
        return cfg.replica_cpus
    return max(1, (os.cpu_count() or 1) // cfg.replicas)


def _capacity(cfg: RayServeConfig) -> int:
    # what one engine admits at once (running + waiting); past it Ray queues at the ingress
    return (cfg.max_running or 32) + cfg.max_waiting


def _json_start(status: int, rid: str):
    return ("start", status, [(b"content-type", b"application/json"),
                              (REPLICA_HEADER.encode(), rid.encode())])


def _error_body(status: int, message: str) -> bytes:
    kind = "not_found_error" if status == 404 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}).encode()


def start_ray(address: str | None = None, *, num_cpus: int | None = None,
              object_store_mb: int = 200) -> None:
    """Connect to the Ray cluster at ``address``, or start a local one on 127.0.0.1."""
    import ray

    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address, log_to_driver=False)
        return
    # "local": a new cluster even where `ray start` left one running on this machine
    ray.init(address="local", num_cpus=num_cpus,
             object_store_memory=object_store_mb * 1024 * 1024, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)


def run_application(cfg: RayServeConfig, host: str, port: int, *,
                    address: str | None = None) -> None:
    """Start Serve's proxy on ``host:port`` and the application, without blocking."""
    import math

    # a local Ray offers at least what the replicas reserve, or the last ones never start
    start_ray(address, num_cpus=max(os.cpu_count() or 1,
                                    math.ceil(cfg.replicas * replica_cpus(cfg))))
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_application(cfg), name=APP_NAME, route_prefix="/")
    log.info("%d paged-serve replicas under Ray Serve at http://%s:%d", cfg.replicas, host,
             port)


def serve_with_ray(cfg: RayServeConfig, host: str, port: int, *,
                   address: str | None = None) -> None:
    """``paged-serve --ray-replicas N``: run the application until SIGINT / SIGTERM, then
    shut Serve down (and the local Ray this started)."""
    import ray

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        run_application(cfg, host, port, address=address)
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        serve.shutdown()
        if address is None:
            ray.shutdown()


__all__ = ["RayServeConfig", "ReplicaCore", "app_builder", "build_application", "run_application",
           "serve_with_ray", "start_ray"]
