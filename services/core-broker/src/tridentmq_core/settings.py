"""Every setting of a core node with its default: the single source of the configuration reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tridentmq_shared.settings import doc
from tridentmq_shared.tls import TlsSection

ENV_PREFIX = "TRIDENTMQ_CORE"


@dataclass(frozen=True)
class NodeSection:
    name: str = doc("core", "Name of this node in logs and status output.")
    data_dir: Path = doc(Path("data/core"), "Directory for the node identity, journal and audit segments.")
    log_level: str = doc("INFO", "Log level: DEBUG, INFO, WARNING or ERROR.")


@dataclass(frozen=True)
class LinkSection:
    host: str = doc("0.0.0.0", "Interface of the internal link listener (gateways and tools connect here).")
    port: int = doc(61616, "Port of the internal link listener (0 = any free port, written to the ports file).")
    heartbeat_ms: int = doc(250, "Heartbeat interval offered to peers; a peer silent for 4 intervals is dead.", least=0)
    max_frame_bytes: int = doc(
        0,
        "Largest link frame accepted; 0 derives it from `broker.max_message_bytes` (that "
        "plus 1 MiB for the rest of a message and 1 KiB for the channel of a gateway's "
        "session, at least 16 MiB). A value set must leave that room: what a node accepts "
        "it can frame to every consumer.",
    )
    publish_window: int = doc(8192, "Publishes a link may have in flight before the core grants more.", least=1)
    publish_window_bytes: int = doc(
        16 * 1024 * 1024,
        "… and body bytes (one message may pass it): with "
        "`broker.max_memory_bytes`, what bounds the memory producers can fill. A "
        "link speaking version 1 of the protocol (no byte credit) gets only as "
        "many publishes as this holds at `broker.max_message_bytes` each, at "
        "least one.",
        least=1,
    )
    max_connections: int = doc(10_000, "Link connections accepted at once; more are refused.", least=1)
    max_channels: int = doc(
        100_000,
        "Sessions one link may carry as channels (a gateway multiplexes its "
        "clients' sessions over a few links: `core.shared_links`); more are "
        "refused with resource-limit. Each costs the node a session's state, not a "
        "connection.",
        least=1,
    )
    handshake_timeout_ms: int = doc(
        10_000,
        "A connection that has not completed HELLO by then is closed "
        "(`resource-limit` when its HELLO still waits for its password "
        "check: the client retries).",
        least=1,
    )
    handshake_max_frame_bytes: int = doc(
        64 * 1024,
        "Largest frame accepted before HELLO succeeds (HELLO takes a "
        "few hundred bytes; at least 1024). Larger ones close the "
        "connection, so an unauthenticated peer holds at most this "
        "much of the node's memory.",
    )
    max_handshaking: int = doc(
        256,
        "Connections that have not completed HELLO (sending it, or waiting for their "
        "password check) held at once; more are refused with resource-limit.",
        least=1,
    )
    tls: bool = doc(
        False,
        "Serve the link over TLS only (certificates in `[tls]`). Links this node opens to "
        "other nodes (cluster connections, replication, votes) then use TLS too, with "
        "`[tls]` as their client certificate: every node of a cluster sets the same. Gateways "
        "and the CLI must connect with TLS (`core.tls`, `tridentmq --tls`).",
    )
    proxy_users: list[str] = doc(
        list,
        "Users that may open links for another user without that user's password: "
        "a gateway's own `core.user`, for MQTT clients it knows by their "
        "certificate (`mqtt.use_identity_as_username`). Such a link has the other "
        "user's permissions, and that user must be configured in `[[users]]`. "
        "Empty: no link acts for another user (with no users configured, loopback "
        "links may, as they may do anything).",
        factory=True,
    )


@dataclass(frozen=True)
class LoginSection:
    verify_threads: int = doc(
        2, "Threads that check hashed passwords (PBKDF2), off the event loop; more checks wait their turn.", least=1
    )
    cache_entries: int = doc(
        10_000,
        "Successful hashed-password checks remembered, so a client reconnecting "
        "with the same credentials skips PBKDF2 (kept in memory as a keyed hash "
        "of user, stored password and password; a changed password or user entry "
        "no longer matches). 0: none.",
        least=0,
    )
    max_pending_per_source: int = doc(
        4,
        "Password checks and delayed refusals one client address may have at "
        "once; its further logins wait (a gateway is one address: its "
        "clients share this).",
        least=1,
    )
    failure_delay_ms: int = doc(
        200,
        "A failed login is refused after this delay, doubled for each further "
        "failure from the same address within `failure_window_ms`.",
        least=0,
    )
    max_failure_delay_ms: int = doc(5000, "Longest delay of a refusal.", least=0)
    failure_window_ms: int = doc(
        60_000,
        "Failures from an address are forgotten after this long without one; "
        "failed logins are logged once per window and address, with a count "
        "at the end of it.",
        least=0,
    )


@dataclass(frozen=True)
class JournalSection:
    enabled: bool = doc(True, "Keep durable messages, queues and addresses in the journal (off: memory only).")
    directory: str = doc(
        "",
        "Where the journal segments go; empty means `<data_dir>/journal`. The running node holds the lock "
        "file `<directory>.lock` beside it, so its parent must be writable.",
    )
    segment_bytes: int = doc(64 * 1024 * 1024, "Size of each pre-allocated journal segment file.", least=64 * 1024)
    sync_delay_us: int = doc(
        0,
        "Pause before each group commit so more records share one fsync (0: sync as soon "
        "as the previous sync ends; `tridentmq core --tune` measures the disk and "
        "suggests a value).",
        least=0,
    )
    max_disk_usage: float = doc(
        90.0,
        "Percent of the journal's filesystem in use above which durable publishes are "
        "refused (resource-limit) until space returns. A journal write that finds the disk "
        "full is retried every second; meanwhile durable publishes and transaction commits "
        "are refused and the node is not ready. The paging directory's filesystem has the same "
        "limit: over it, publishes that a queue would page are refused.",
        least=0,
        most=100,
    )
    compact_min_segments: int = doc(4, "Compaction is considered once the journal has this many segments.", least=1)
    compact_live_ratio: float = doc(
        0.5,
        "… and runs when live durable messages are fewer than this fraction of "
        "the records written since the last compaction.",
    )


@dataclass(frozen=True)
class ManagementSection:
    enabled: bool = doc(True, "Serve /healthz, /readyz, /metrics and the JSON API over HTTP.")
    host: str = doc("127.0.0.1", "Interface of the management HTTP server.")
    port: int = doc(8161, "Port of the management HTTP server (0 = any free port).")
    tls: bool = doc(False, "Serve HTTPS instead of HTTP on that port (certificates in `[tls]`).")
    allowed_hosts: list[str] = doc(
        list,
        "Host names requests may carry in their Host header besides loopback "
        "names, the address they came in on, `management.host`, `link.host` and "
        "`cluster.advertise_host` (a check against DNS rebinding); `*` allows "
        "any.",
        factory=True,
    )
    public_metrics: bool = doc(
        True,
        "/metrics answers without credentials even when users are configured (it "
        "holds names and counts, no secret); false: it needs the manage permission "
        "like /api.",
    )
    request_timeout_ms: int = doc(
        10_000,
        "A connection must send a whole request head within this, and a request's whole body within as long "
        "after its head (else 408 and closed); it is closed after as long idle.",
        least=1,
    )
    max_connections: int = doc(
        256, "HTTP connections open at once; more get 503 and are closed (logged once a minute).", least=1
    )


@dataclass(frozen=True)
class AuditSection:
    enabled: bool = doc(True, "Write the audit stream (JSON lines segments, see docs/audit.md).")
    directory: str = doc("", "Where segments go; empty means `<data_dir>/audit`.")
    roll_bytes: int = doc(64 * 1024 * 1024, "Seal a segment when it reaches this size.", least=1)
    roll_seconds: float = doc(60.0, "Seal a segment when it is this old.", least=0.001)
    heartbeat_seconds: float = doc(
        10.0, "Interval of node.heartbeat events (they advance Spark watermarks).", least=0.001
    )
    message_events: str = doc(
        "durable",
        "Per-message events (msg.sent, msg.acked, …): `all`, `durable` (only "
        "durable messages, the default: non-durable traffic can outrun the writer) "
        "or `none`. Lifecycle, expiry and dead-letter events are always written.",
    )


@dataclass(frozen=True)
class BrokerSection:
    dedup_window_seconds: float = doc(600.0, "How long a duplicate-detection id is remembered.", least=0)
    dedup_max_entries: int = doc(
        1_000_000,
        "Most duplicate-detection ids remembered (oldest forgotten first). "
        "The link client's numbered ids count one per run of consecutive numbers; "
        "non-durable transfers from other nodes are kept apart, as many again.",
        least=0,
    )
    max_message_bytes: int = doc(8 * 1024 * 1024, "Largest message body accepted.", least=1)
    max_consumer_credit: int = doc(100_000, "Largest delivery window one consumer may grant.", least=1)
    max_auto_created_addresses_per_user: int = doc(
        100_000,
        "Addresses one user's publishes may have auto-created "
        "and still in use; beyond, a publish to a new address "
        "is refused with resource-limit (0 = no cap; cluster "
        "connections are exempt).",
        least=0,
    )
    expiry_scan_ms: int = doc(1000, "Interval of the scan that expires messages no consumer is reading.", least=1)
    max_memory_bytes: int = doc(
        1024 * 1024 * 1024,
        "Memory for queued messages (bodies plus ~256 bytes each); "
        "above it producers get no publish credit until usage is back under 90 %.",
        least=1,
    )
    max_transaction_bytes: int = doc(
        64 * 1024 * 1024,
        "Messages the open transactions of one link session may hold until their "
        "commits (bodies plus ~256 bytes each); a publish beyond is refused with "
        "resource-limit and its transaction can only roll back.",
        least=1,
    )
    max_open_transactions: int = doc(
        64,
        "Transactions one link session may have open at once; a BEGIN beyond is refused with resource-limit.",
        least=1,
    )


LOAD_BALANCING_POLICIES = ("OFF", "STRICT", "ON_DEMAND", "OFF_WITH_REDISTRIBUTION")


@dataclass(frozen=True)
class ClusterSection:
    name: str = doc("tridentmq", "Cluster name: a node joins only nodes that announce the same name.")
    user: str = doc(
        "",
        "User of the cluster connections between nodes. Cluster credentials have no default: "
        "a node with connectors or discovery but no user and password refuses to start.",
    )
    password: str = doc("", "Password of the cluster connections (the same on every node).")
    connectors: list[str] = doc(
        list,
        "Static connectors: `host:port` of other nodes' link listeners. A node "
        "learns the rest of the cluster from the nodes it reaches.",
        factory=True,
    )
    discovery: str = doc(
        "",
        "Redis URL of the broadcast and discovery group (`redis://host:6379/0`); empty: "
        "static connectors only. Redis carries announcements, never messages.",
    )
    broadcast_period_ms: int = doc(1000, "Interval of this node's announcements (discovery).", least=1)
    refresh_timeout_ms: int = doc(5000, "An announcement not refreshed for this long is dropped (discovery).", least=1)
    advertise_host: str = doc(
        "", "Host other nodes connect to for this node's link; empty: `link.host`, or 127.0.0.1 when that is 0.0.0.0."
    )
    max_hops: int = doc(
        1,
        "How far bindings travel: 1 = every node links to every other (symmetric mesh); "
        "2 or more lets messages cross intermediate nodes (chains). The same on every "
        "node.",
        least=1,
    )
    message_load_balancing: str = doc(
        "ON_DEMAND",
        "OFF (never forward), STRICT (round-robin over every node "
        "with the queue), ON_DEMAND (only to nodes with matching "
        "consumers) or OFF_WITH_REDISTRIBUTION (local routing, but "
        "backlog moves to where the consumers are).",
    )
    forward_window: int = doc(
        10_000,
        "Forwarded messages in flight to one node (and per queue being "
        "redistributed) before waiting for its confirms; also how many "
        "published messages may wait in memory for room on the link to one "
        "node before more go to its store-and-forward queue.",
        least=1,
    )
    min_residence_ms: int = doc(
        2000,
        "A message that came from another node is not redistributed again "
        "before this long (no ping-pong when consumers flap); doubled for each "
        "time it was already redistributed, up to 4 times.",
        least=0,
    )
    retry_interval_ms: int = doc(100, "First retry delay of a cluster connection that failed.", least=1)
    retry_multiplier: float = doc(2.0, "Factor applied to the retry delay after each failed attempt.", least=1)
    max_retry_interval_ms: int = doc(2000, "Longest retry delay of a cluster connection.", least=1)
    join_wait_ms: int = doc(
        3000,
        "A node that starts or takes over serves clients only once every other node it "
        "knows (connectors, discovery) has answered its cluster connection with its "
        "queues, or failed to, or this long has passed: before, a message for a "
        "subscription on another node would be routed nowhere. 0: serve at "
        "once.",
        least=0,
    )
    node_gone_ms: int = doc(
        10_000,
        "A node unreachable for this long is declared gone: the messages waiting to "
        "be forwarded to it (publishes re-sent here that it may have stored among "
        "them) are routed again among the nodes that remain.",
        least=1,
    )
    max_bindings: int = doc(
        100_000, "Bindings accepted from one node; beyond, its updates are refused (flood).", least=1
    )
    scale_down: bool = doc(
        True,
        "On a graceful stop, move this node's messages (durable and not) to another "
        "live node of the cluster before exiting, so none wait for this node's "
        "return. Not while a backup holds them (in sync): it takes over instead.",
    )
    scale_down_timeout_ms: int = doc(
        30_000, "Longest a graceful stop spends moving messages; what is left stays in this node's journal.", least=0
    )


@dataclass(frozen=True)
class NetworkCheckSection:
    targets: list[str] = doc(
        list,
        "Addresses to probe: `host:port` (a TCP connect) or `icmp:host` (one ping). "
        "A node that reaches none of them for `failures_to_isolate` rounds stops "
        "serving, and serves again once one answers; an isolated backup never takes "
        "over. Empty: no check.",
        factory=True,
    )
    period_ms: int = doc(2000, "Interval of the probe rounds.", least=1)
    timeout_ms: int = doc(1000, "How long a probe may take (below the period).", least=1)
    failures_to_isolate: int = doc(2, "Rounds in a row with no answer before the node counts as isolated.", least=1)


@dataclass(frozen=True)
class HaSection:
    policy: str = doc(
        "none",
        "`none`; `replication`: this node is one half of a primary/backup pair whose "
        "backup receives the journal stream (a pair needs the cluster credentials); or "
        "`shared-store`: both halves use the journal in `shared_directory`, and the one "
        "holding its lease serves (see docs/ha.md).",
    )
    role: str = doc(
        "primary",
        "`primary` (active at first start) or `backup` (waits, copies its primary's "
        "journal, and takes over when the primary is lost and a quorum agrees).",
    )
    group_name: str = doc("", "Names the pair: a backup replicates only the primary with the same group name.")
    vote_on_replication_failure: bool = doc(
        True,
        "A primary that loses its in-sync backup keeps confirming "
        "durable writes only after a quorum of the other primaries "
        "agrees that no backup took over, and stops confirming "
        "while it cannot reach a quorum.",
    )
    activate_without_quorum: bool = doc(
        False,
        "Let an in-sync backup take over when there are no other "
        "primaries to vote (a single pair). Risks two active nodes "
        "when the primary was only cut off, not dead.",
    )
    vote_grace_ms: int = doc(
        500,
        "A voter grants a takeover only after the primary has been unreachable from "
        "it for this long (the primary notices its own isolation sooner).",
        least=0,
    )
    vote_retry_ms: int = doc(250, "Interval of a backup's vote rounds while its primary is lost.", least=1)
    allow_failback: bool = doc(
        True,
        "A backup that took over hands the pair back to its primary once the "
        "primary, returned, is in sync as its backup (then it becomes the backup "
        "again).",
    )
    shared_directory: str = doc(
        "",
        "shared-store: the directory both halves of the pair use (a network "
        "filesystem), holding the lease, the pair's identity and its journal.",
    )
    lease_renew_ms: int = doc(1000, "shared-store: how often the active node renews its lease.", least=1)
    lease_expiry_ms: int = doc(
        5000,
        "shared-store: a lease not renewed for this long (by the waiting node's own "
        "clock) has expired and the waiting node takes over; it must exceed twice "
        "the renewal interval.",
        least=1,
    )
    sync_window: int = doc(
        50_000, "Journal records in flight to the backup before the primary waits for its acknowledgements.", least=1
    )
    max_backlog_bytes: int = doc(
        256 * 1024 * 1024,
        "Journal records the primary holds for its backup beyond `sync_window`; a backup that falls "
        "this far behind is dropped (with a warning) and copies the journal again.",
        least=1,
    )


@dataclass(frozen=True)
class SecuritySection:
    allow_anonymous_remote: bool = doc(
        False,
        "With no [[users]] configured, accept clients from other hosts too "
        "(anonymous, with every right). Off, only clients on this host "
        "(loopback) are accepted: a gateway's clients count by their own "
        "address, not the gateway's. Meaningless once users are "
        "configured.",
    )


@dataclass(frozen=True)
class UserEntry:
    name: str = doc("", "User name.")
    password: str = doc("", "Password, plain or `pbkdf2_sha256$iterations$salt_hex$hash_hex`.")
    roles: list[str] = doc(list, "Roles of this user.", factory=True)


@dataclass(frozen=True)
class PermissionEntry:
    match: str = doc("#", "Address pattern (`*` one word, `#` any words) this grant applies to.")
    permission: str = doc(
        "send",
        "One of send, consume, browse, createAddress, deleteAddress, createDurableQueue, "
        "deleteDurableQueue, createNonDurableQueue, deleteNonDurableQueue, manage "
        "(manage on `$sys.management`: the management API's /api).",
    )
    roles: list[str] = doc(list, "Roles granted the permission on matching addresses.", factory=True)
    deny: bool = doc(
        False,
        "A deny rule: refuses the permission on matching addresses to these roles. A deny "
        "wins over every grant, however specific; a wildcard subscription is refused when "
        "any address it can match is denied.",
    )


@dataclass(frozen=True)
class AddressSettingsEntry:
    match: str = doc("#", "Address pattern; the most specific match wins, unset fields fall through.")
    dead_letter_address: str | None = doc(
        None, 'Where messages go after max delivery attempts (default `DLQ`; `""` = drop).'
    )
    expiry_address: str | None = doc(None, 'Where expired messages go (default `ExpiryQueue`; `""` = drop).')
    max_delivery_attempts: int | None = doc(None, "Deliveries before dead-lettering (default 10; -1 = forever).")
    redelivery_delay_ms: int | None = doc(None, "Delay before a nacked message is redelivered (default 0).")
    redelivery_multiplier: float | None = doc(
        None, "Factor applied to the delay per attempt (default 1.0; at least 1.0)."
    )
    max_redelivery_delay_ms: int | None = doc(None, "Cap of the redelivery delay (default 60000).")
    auto_create_addresses: bool | None = doc(None, "Create an address on first use (default true).")
    auto_create_queues: bool | None = doc(None, "Create a queue on first subscribe (default true).")
    auto_delete_queues: bool | None = doc(None, "Delete auto-created queues when unused (default true).")
    auto_delete_addresses: bool | None = doc(
        None, "Delete auto-created addresses when unused: no queue and no publish (default true)."
    )
    auto_delete_addresses_delay_ms: int | None = doc(
        None,
        "How long an auto-created address stays unused before "
        "it is deleted (default 0; it is looked at every "
        "`broker.expiry_scan_ms`, so one that lost its last "
        "queue goes at once, one that never had a queue after "
        "one to two scans without a publish).",
    )
    auto_create_dead_letter_resources: bool | None = doc(
        None,
        "Create the dead-letter (and expiry) address "
        "with an anycast queue of the same name when "
        "first needed (default true).",
    )
    max_size_bytes: int | None = doc(
        None, "Bytes an address's queues may hold (default -1: no limit but the broker's memory limit)."
    )
    address_full_policy: str | None = doc(
        None,
        "When max_size_bytes is reached: PAGE (the default: each queue of "
        "the address keeps further messages in a page file and reads them "
        "back in order as consumers catch up), BLOCK (producers get no "
        "credit until it drains below 90 %), FAIL (publishes are rejected "
        "with resource-limit) or DROP (confirmed and discarded).",
    )
    default_routing_type: str | None = doc(
        None, "Routing type of auto-created addresses: anycast or multicast (default anycast)."
    )
    redistribution_delay_ms: int | None = doc(
        None,
        "In a cluster, how long a queue with messages and no "
        "consumer waits before moving its messages to a node "
        "that has consumers for it (default 1000; -1 = never, "
        "0 = at once).",
    )


@dataclass(frozen=True)
class CoreSettings:
    node: NodeSection = doc(NodeSection(), "This node.")
    link: LinkSection = doc(LinkSection(), "The internal link listener.")
    login: LoginSection = doc(
        LoginSection(),
        "Password checks of link logins (HELLO), off the event loop, with a cache and a per-address backoff.",
    )
    journal: JournalSection = doc(JournalSection(), "The durable journal.")
    management: ManagementSection = doc(ManagementSection(), "Management HTTP server.")
    audit: AuditSection = doc(AuditSection(), "The audit stream.")
    broker: BrokerSection = doc(BrokerSection(), "Broker limits and windows.")
    cluster: ClusterSection = doc(
        ClusterSection(), "Clustering: cluster connections, load balancing, redistribution and discovery."
    )
    ha: HaSection = doc(HaSection(), "High availability: primary/backup replication pairs.")
    network_check: NetworkCheckSection = doc(NetworkCheckSection(), "The network health check.")
    tls: TlsSection = doc(
        TlsSection(),
        "TLS certificates of the link (`link.tls`) and management "
        "(`management.tls`) listeners, and of the links to other nodes.",
    )
    security: SecuritySection = doc(SecuritySection(), "Anonymous access while no users are configured.")
    users: list[UserEntry] = doc(
        list,
        "Users. With none, loopback clients (a gateway's clients by their own "
        "address) are accepted whatever their credentials and other addresses "
        "are refused, unless security.allow_anonymous_remote.",
        factory=True,
    )
    permissions: list[PermissionEntry] = doc(list, "Role grants (and deny rules) per address pattern.", factory=True)
    address_settings: list[AddressSettingsEntry] = doc(list, "Per-address behaviour, matched by pattern.", factory=True)
