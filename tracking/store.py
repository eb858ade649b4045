"""Where runs go and whether that store answers: the tracking-URI rule, reachability and write
probes, the one `ensure_experiment`, and clients that fail fast on a down server.

The tracking-URI rule (the one statement of it; every CLI, the training config and the sweep
spec resolve through `resolve_uri`):

    an explicit argument (a CLI flag such as `--tracking-uri`)
    > the environment variable MLFLOW_TRACKING_URI
    > the configured value (`run.tracking_uri` of a training config, `mlflow.tracking_uri` of a spec)
    > sqlite:///<cwd>/mlflow.db (what `mlflow ui` opens when started in the same directory)

A plain path is made absolute, and so is the path of a relative `sqlite:///` URI, so every process
of a sweep names the same store whatever its working directory. Leaves out: runs (tracking/runs.py)
and evaluation runs (tracking/evaluations.py).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

TRACKING_ENV = "MLFLOW_TRACKING_URI"
DEFAULT_DB = "mlflow.db"
#: the experiment tag MLflow 3's UI reads for an experiment's kind, and the classic kind's value
#: (mlflow/server/js: ExperimentKind.CUSTOM_MODEL_DEVELOPMENT, shown as "Machine learning")
KIND_TAG = "mlflow.experimentKind"
CLASSIC_KIND = "custom_model_development"
#: the write probe sets, then deletes, an experiment tag of this name (+ host and pid: probes of
#: concurrent workers never delete each other's), so no probe is left on the experiment
PROBE_TAG = "mtpc.write_probe"


class TrackingError(RuntimeError):
    """The MLflow tracking store is unreachable, unwritable, or did not store what was asked."""


@dataclass(frozen=True)
class TrackingURI:
    uri: str
    source: str  # where the rule found it, for messages: "--tracking-uri", "MLFLOW_TRACKING_URI", ...


def resolve_uri(
    configured: str | None = None,
    *,
    explicit: str | None = None,
    explicit_source: str = "--tracking-uri",
    configured_source: str = "the config",
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> TrackingURI:
    """Apply the tracking-URI rule of this module's docstring; `env` defaults to os.environ."""
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    if explicit:
        return TrackingURI(absolute_uri(explicit, cwd), explicit_source)
    if env.get(TRACKING_ENV):
        return TrackingURI(absolute_uri(env[TRACKING_ENV], cwd), TRACKING_ENV)
    if configured:
        return TrackingURI(absolute_uri(configured, cwd), configured_source)
    return TrackingURI(
        f"sqlite:///{(cwd / DEFAULT_DB).resolve()}", f"the default (sqlite:///<cwd>/{DEFAULT_DB})"
    )


def absolute_uri(uri: str, cwd: Path) -> str:
    """`uri` with a relative sqlite path or plain path made absolute against `cwd`."""
    if uri.startswith("sqlite:///"):
        rest = uri[len("sqlite:///") :]
        path, q, query = rest.partition("?")
        if path and path != ":memory:" and not Path(path).is_absolute():
            return f"sqlite:///{(cwd / path).resolve()}" + (q + query)
        return uri
    if "://" not in uri and not uri.startswith("file:"):
        p = Path(uri).expanduser()
        return str(p if p.is_absolute() else (cwd / p).resolve())
    return uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI (None for in-memory stores or other schemes)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def client(uri: str):
    """An `MlflowClient` bound to `uri` (explicit run ids everywhere: no fluent global state, so
    several trials in one process never mix runs)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


@contextmanager
def quick_failures(timeout_s: int = 10) -> Iterator[None]:
    """Fail fast on a down server: MLflow retries HTTP calls with backoff for minutes by default.
    Only variables the user did not set are touched, and only inside the block."""
    overrides = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s)}
    added = [k for k in overrides if k not in os.environ]
    for k in added:
        os.environ[k] = overrides[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def short(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line of at most `limit` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_tracking(uri: str, timeout: float = 5.0) -> None:
    """Raise TrackingError unless a store for writing can be reached: http(s) answers /health;
    sqlite: the database path is a file or absent (not a folder), its directory exists or can be
    created and is writable; file: the directory exists or can be created and is writable; other schemes
    (postgresql://, databricks, ...): the client can list experiments."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (the user's URI)
                if r.status != 200:
                    raise TrackingError(f"MLflow tracking server {uri}: /health answered HTTP {r.status}")
        except (TimeoutError, urllib.error.URLError, OSError) as e:
            raise TrackingError(
                f"MLflow tracking server {uri} is unreachable ({e}); start it or fix the tracking URI / {TRACKING_ENV}"
            ) from e
        return
    if parsed.scheme == "sqlite":
        path = sqlite_path(uri)
        if path is None:
            raise TrackingError(f"MLflow URI {uri}: expected sqlite:///<path>")
        if path.is_dir():
            raise TrackingError(
                f"MLflow store {uri}: {path} is a directory, not a database file; "
                f"name a file, e.g. sqlite:///{path / DEFAULT_DB}"
            )
        if path.exists() and not path.is_file():
            raise TrackingError(f"MLflow store {uri}: {path} is not a regular file")
        _writable_dir(path.parent, f"MLflow store {uri}")
        return
    if parsed.scheme in ("", "file"):
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
            raise TrackingError(
                f"MLflow URI {uri} is a plain file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true; "
                "use sqlite:///<path> or an http server"
            )
        _writable_dir(Path(parsed.path or uri), f"MLflow store {uri}")
        return
    try:
        with quick_failures():
            client(uri).search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 (any driver error means: unreachable)
        raise TrackingError(f"MLflow tracking URI {uri} is unreachable: {short(e)}") from e


def _writable_dir(d: Path, what: str) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".probe-"):
            pass
    except OSError as e:
        raise TrackingError(f"{what}: directory {d} is not writable ({e})") from e


def probe_write(uri: str, experiment_id: str, attempts: int = 3) -> str | None:
    """None if the store takes a real write (an experiment tag, set and deleted again), else a
    one-line problem that names the URI. Each attempt fails fast (no HTTP retries); a failed one is tried again after 1 s, then
    2 s, so a busy store (a locked sqlite database behind a server under concurrent writes) is not
    taken for a lost one. Cheap enough to call before every trial."""
    detail = ""
    for i in range(attempts):
        if i:
            time.sleep(2.0 ** (i - 1))
        try:
            check_tracking(uri)
            key = f"{PROBE_TAG}.{socket.gethostname()}.{os.getpid()}"
            with quick_failures():
                c = client(uri)
                c.set_experiment_tag(experiment_id, key, str(time.time()))
                c.delete_experiment_tag(experiment_id, key)
            return None
        except Exception as e:  # noqa: BLE001 (whatever failed, the store did not take the write)
            detail = str(e) if isinstance(e, TrackingError) else f"a write failed: {short(e)}"
    return f"MLflow tracking store {uri} cannot be written ({detail}; {attempts} attempts)"


def open_for_reading(uri: str, source: str = "--tracking-uri"):
    """A client for reading `uri`, after checking that the store answers. A sqlite file that does
    not exist is an error (MLflow would silently create an empty store there)."""
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise TrackingError(
            f"no MLflow database at {db} (tracking URI {uri!r} from {source}); pass --tracking-uri "
            f"or set {TRACKING_ENV} to the store your sweep logged to"
        )
    c = client(uri)
    try:
        with quick_failures():
            c.search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - any failure here means "cannot read the store"
        raise TrackingError(
            f"cannot reach the MLflow tracking store {uri!r} (from {source}): {short(exc)}"
        ) from None
    return c


def ensure_experiment(uri: str, name: str) -> str:
    """The id of experiment `name`, created if missing. A sweep calls it once (its --init) before
    any worker starts; workers then select the experiment by id. Local stores keep artifacts next
    to the database (`<dir>/mlartifacts`), not in ./mlruns of whatever cwd a job has. The
    experiment is of the classic kind (`mlflow.experimentKind`, tracking/views.py), so MLflow 3's
    UI opens it on its runs, not on the GenAI overview; an experiment without the tag gets it."""
    from mlflow.exceptions import MlflowException

    c = client(uri)
    exp = c.get_experiment_by_name(name)
    if exp is None:
        db = sqlite_path(uri)
        artifacts = (db.parent / "mlartifacts").resolve().as_uri() if db is not None else None
        try:
            return c.create_experiment(name, artifact_location=artifacts, tags={KIND_TAG: CLASSIC_KIND})
        except MlflowException:  # created concurrently: read it back
            exp = c.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} at {uri} exists but is deleted; restore it or pick another name"
        )
    if KIND_TAG not in exp.tags:
        c.set_experiment_tag(exp.experiment_id, KIND_TAG, CLASSIC_KIND)
    return exp.experiment_id


def experiment_id(uri: str, name: str) -> str | None:
    """The id of an existing, active experiment `name`, else None (never creates one)."""
    exp = client(uri).get_experiment_by_name(name)
    return None if exp is None or exp.lifecycle_stage == "deleted" else exp.experiment_id
