"""How to reach the Redis that holds the log: URL, credentials, TLS, cluster, time-outs.

Plain data checked when built (a bad URL fails here, not at the first command); it imports
no Redis client, so every layer can name it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ConfigError

__all__ = ["RedisSettings", "redact"]

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SCHEMES = ("redis", "rediss", "unix", *_CLUSTER_SCHEMES)
_WHERE = "--redis-url / ROLLOUT_REDIS_URL"


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages)."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    return f"{scheme}://{credentials.partition(':')[0]}:***@{host}"


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Connection settings; ``socket_timeout`` always exceeds the longest blocking read.

    Credentials: the URL's (``redis://user:password@host:port/db``), else
    ``username``/``password``. TLS: a ``rediss://`` URL, the server's certificate always
    verified against ``tls_ca_file`` (unset: the system's CAs); ``tls_cert_file`` +
    ``tls_key_file``: a client certificate. Cluster: ``redis+cluster://host:port``
    (``rediss+cluster://``) or ``cluster=True``, the host any node, database 0 only.
    """

    url: str = "redis://127.0.0.1:6379/0"
    block_ms: int = 2000
    connect_timeout_s: float = 5.0
    socket_margin_s: float = 5.0
    max_connections: int = 64
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    cluster: bool = False
    health_check_s: float = 0.5

    def __post_init__(self) -> None:
        scheme, sep, rest = self.url.partition("://")
        if not sep or scheme not in _SCHEMES:
            raise ConfigError(
                f"Redis URL {redact(self.url)!r} ({_WHERE}) needs a scheme: "
                f"redis://host:port/db, rediss://host:port/db, unix:///path/to/socket or "
                f"redis+cluster://host:port"
            )
        tls_knobs = [
            name
            for name in ("tls_ca_file", "tls_cert_file", "tls_key_file")
            if getattr(self, name) is not None
        ]
        if tls_knobs and not self.tls:
            raise ConfigError(
                f"RedisSettings: {', '.join(tls_knobs)} set but the URL is not rediss:// "
                f"(got {redact(self.url)!r})"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("RedisSettings: tls_cert_file and tls_key_file go together")
        if self.is_cluster:
            if scheme == "unix":
                raise ConfigError(
                    f"RedisSettings: a cluster URL must be redis+cluster://host:port or "
                    f"rediss+cluster://host:port (got {redact(self.url)!r})"
                )
            db = rest.partition("/")[2].partition("?")[0]
            if db not in ("", "0"):
                raise ConfigError(
                    f"RedisSettings: a Redis Cluster has only database 0, the URL names "
                    f"database {db!r} ({redact(self.url)!r})"
                )

    @property
    def socket_timeout_s(self) -> float:
        return self.block_ms / 1000.0 + self.socket_margin_s

    @property
    def is_cluster(self) -> bool:
        return self.cluster or self.url.partition("://")[0] in _CLUSTER_SCHEMES

    @property
    def tls(self) -> bool:
        return self.url.partition("://")[0] in ("rediss", "rediss+cluster")

    @property
    def client_url(self) -> str:
        """The URL without the scheme's ``+cluster``, as redis-py takes it."""
        scheme, sep, rest = self.url.partition("://")
        return f"{_CLUSTER_SCHEMES.get(scheme, scheme)}{sep}{rest}"
