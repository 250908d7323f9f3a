//! Membership in etcd: this sidecar's record under the cluster prefix, kept
//! alive by a lease, and a watch on the prefix. The decisions (what a record
//! means, who joined, restarted or left) are `kvrail_core::membership`'s;
//! this file only talks to etcd and hands each [`Change`] to the daemon
//! (`peer_changes` applies them to the peer table).
//!
//! etcd says where a peer is and which certificate it presents; the
//! certificate, checked at every handshake, says who it is. Losing etcd
//! changes nothing for peers already known: their sessions and transfers go
//! on, and the sidecar registers again when etcd is back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity,
    PutOptions, TlsOptions, Txn, TxnOp, TxnOpResponse, WatchOptions, WatchResponse,
};
use kvrail_core::membership::{
    node_key, nodes_prefix, takeover, Change, MemberRecord, MemberView, StoreEvent, Takeover,
};
use tokio::sync::{oneshot, Semaphore};
use tracing::{info, warn};

use crate::metrics as m;

/// Longest wait for one etcd call (a lookup, a registration step).
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest a dial or handshake waits to resolve an unknown name in etcd.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);
/// Lookups of unknown names running at once (a flood of made-up names in
/// hellos costs etcd at most this many reads at a time).
const MAX_LOOKUPS: usize = 4;
/// Waits between attempts to reach etcd again.
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// Longest a graceful stop waits to delete this node's record.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a membership session with etcd ended.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("etcd did not answer {what} within {CALL_TIMEOUT:?}")]
    Timeout { what: &'static str },
    #[error("etcd ended the {0} stream")]
    StreamEnded(&'static str),
    #[error("this node's lease expired in etcd (not renewed in time)")]
    LeaseExpired,
    #[error("etcd cancelled the watch ({0}); reading the prefix again")]
    WatchCancelled(String),
    #[error("another process (incarnation {incarnation:#x}, rails {rails}) holds this node's name in etcd; registering once its record is gone (two sidecars configured with one name?)")]
    NameTaken { incarnation: u64, rails: String },
    #[error("this node's record changed while registering; trying again")]
    Raced,
    #[error("this node's record was deleted from etcd while it ran; registering again")]
    RecordDeleted,
}

/// Where and how this node registers.
#[derive(Debug, Clone)]
pub struct MembershipConfig {
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub lease_ttl_s: u64,
    /// What this node publishes (its name, rails, process, certificate).
    pub record: MemberRecord,
    /// For `https://` endpoints: whom to trust and what to show.
    pub tls: Option<EtcdTls>,
}

/// TLS towards etcd: the CA that signed etcd's certificates and, when etcd
/// asks for one, this node's client certificate and key (all PEM, read at
/// start so a bad file stops the daemon there, not at the first reconnect).
#[derive(Clone)]
pub struct EtcdTls {
    pub ca_pem: Vec<u8>,
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

impl EtcdTls {
    /// Reads the files; None when no CA is configured (plain http).
    pub fn load(
        ca: Option<&std::path::Path>,
        cert: Option<&std::path::Path>,
        key: Option<&std::path::Path>,
    ) -> anyhow::Result<Option<EtcdTls>> {
        use anyhow::Context;
        let Some(ca) = ca else { return Ok(None) };
        let read = |p: &std::path::Path, what: &str| {
            std::fs::read(p).with_context(|| format!("{what} {}", p.display()))
        };
        let ca_pem = read(ca, "etcd_ca")?;
        if !String::from_utf8_lossy(&ca_pem).contains("-----BEGIN CERTIFICATE-----") {
            anyhow::bail!("etcd_ca {}: no PEM certificate in it", ca.display());
        }
        let identity = match (cert, key) {
            (Some(c), Some(k)) => Some((read(c, "etcd_cert")?, read(k, "etcd_key")?)),
            _ => None,
        };
        Ok(Some(EtcdTls { ca_pem, identity }))
    }

    fn options(&self) -> TlsOptions {
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        if let Some((cert, key)) = &self.identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        tls
    }
}

/// What the daemon does with each change (applies it to its peer table).
pub type OnChange = Arc<dyn Fn(Change) + Send + Sync>;

/// The running membership: lookups and a graceful stop. Dropping it stops
/// the background task (the record then expires with its lease).
pub struct Membership {
    inner: Arc<Inner>,
    stop: Mutex<Option<oneshot::Sender<oneshot::Sender<()>>>>,
}

struct Inner {
    config: MembershipConfig,
    view: Mutex<MemberView>,
    on_change: OnChange,
    /// The connected client, while there is one (lookups borrow it).
    client: Mutex<Option<Client>>,
    lookups: Semaphore,
}

impl Inner {
    fn emit(&self, change: Option<Change>) {
        if let Some(change) = change {
            m::membership_events(change_kind(&change)).increment(1);
            (self.on_change)(change);
        }
    }
}

/// A change's metric label.
fn change_kind(change: &Change) -> &'static str {
    match change {
        Change::Joined(_) => "joined",
        Change::Updated { .. } => "updated",
        Change::Restarted { .. } => "restarted",
        Change::Left { .. } => "left",
        Change::Refused(_) => "refused",
        Change::NameClash { .. } => "name_clash",
    }
}

impl Membership {
    /// Starts registering and watching in the background.
    pub fn start(config: MembershipConfig, on_change: OnChange) -> Membership {
        let inner = Arc::new(Inner {
            view: Mutex::new(MemberView::new(
                &config.prefix,
                &config.record.node,
                config.record.incarnation,
                kvrail_auth::check_node_name,
            )),
            config,
            on_change,
            client: Mutex::new(None),
            lookups: Semaphore::new(MAX_LOOKUPS),
        });
        let (stop_tx, stop_rx) = oneshot::channel();
        tokio::spawn(run(inner.clone(), stop_rx));
        Membership {
            inner,
            stop: Mutex::new(Some(stop_tx)),
        }
    }

    /// Deletes this node's record and stops; bounded.
    pub async fn leave(&self) {
        let Some(stop) = lock(&self.stop).take() else {
            return;
        };
        let (done_tx, done_rx) = oneshot::channel();
        if stop.send(done_tx).is_ok() {
            let _ = tokio::time::timeout(LEAVE_TIMEOUT, done_rx).await;
        }
    }

    /// Reads `node`'s record from etcd now (a name the watch has not
    /// brought yet); what it changes goes to the daemon as any change does.
    pub async fn lookup(&self, node: &str) {
        let inner = &self.inner;
        if kvrail_auth::check_node_name(node).is_err() {
            return;
        }
        let Ok(_permit) = inner.lookups.try_acquire() else {
            return;
        };
        let Some(mut client) = lock(&inner.client).clone() else {
            return;
        };
        let key = node_key(&inner.config.prefix, node);
        let Ok(Ok(resp)) = tokio::time::timeout(LOOKUP_TIMEOUT, client.get(key, None)).await else {
            return;
        };
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let change = lock(&inner.view).learn(&key, kv.value(), kv.mod_revision());
            inner.emit(change);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every write under these locks is one assignment: a panic cannot leave
    // a half-made state behind.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn run(inner: Arc<Inner>, mut stop: oneshot::Receiver<oneshot::Sender<()>>) {
    let mut retry = RETRY_MIN;
    loop {
        let ended = tokio::select! {
            r = session(&inner, &mut retry) => r,
            done = &mut stop => {
                if let Ok(done) = done {
                    leave_now(&inner).await;
                    let _ = done.send(());
                }
                return;
            }
        };
        m::membership_connected().set(0.0);
        *lock(&inner.client) = None;
        if let Err(e) = ended {
            warn!(
                retry_in = ?retry,
                "membership: {e}; known peers are kept and served, registering again when etcd answers"
            );
        }
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            done = &mut stop => {
                if let Ok(done) = done {
                    let _ = done.send(());
                }
                return;
            }
        }
        retry = (retry * 2).min(RETRY_MAX);
    }
}

/// Deletes our record, if it is still ours (a newer process of this node
/// may have written the key).
async fn leave_now(inner: &Inner) {
    let Some(mut client) = lock(&inner.client).clone() else {
        return;
    };
    let key = node_key(&inner.config.prefix, &inner.config.record.node);
    let deleted = tokio::time::timeout(LEAVE_TIMEOUT, async {
        let txn = Txn::new()
            .when([Compare::value(
                key.clone(),
                CompareOp::Equal,
                inner.config.record.to_json(),
            )])
            .and_then([TxnOp::delete(key, None)]);
        client.txn(txn).await
    })
    .await;
    match deleted {
        Ok(Ok(_)) => info!("membership: left the cluster (record deleted)"),
        Ok(Err(e)) => warn!("membership: could not delete this node's record: {e}"),
        Err(_) => warn!("membership: etcd did not answer the delete of this node's record"),
    }
}

/// Writes this node's record under `key` with `lease`, unless another
/// process holds the name ([`takeover`]).
async fn register(
    client: &mut Client,
    key: &str,
    record: &MemberRecord,
    lease: i64,
) -> Result<(), MembershipError> {
    let put = || {
        TxnOp::put(
            key,
            record.to_json(),
            Some(PutOptions::new().with_lease(lease)),
        )
    };
    let first = Txn::new()
        .when([Compare::version(key, CompareOp::Equal, 0)])
        .and_then([put()])
        .or_else([TxnOp::get(key, None)]);
    let resp = timed("register", client.txn(first)).await?;
    if resp.succeeded() {
        return Ok(());
    }
    let existing = resp.op_responses().into_iter().find_map(|r| match r {
        TxnOpResponse::Get(g) => g
            .kvs()
            .first()
            .map(|kv| (kv.value().to_vec(), kv.mod_revision())),
        _ => None,
    });
    let Some((value, revision)) = existing else {
        return Err(MembershipError::Raced);
    };
    match takeover(&value, record) {
        Takeover::Taken { incarnation, rails } => {
            return Err(MembershipError::NameTaken {
                incarnation,
                rails: rails.join(","),
            })
        }
        Takeover::Restart { incarnation } => info!(
            old_incarnation = format_args!("{incarnation:#x}"),
            "membership: replacing the record of this node's previous process"
        ),
        Takeover::Own | Takeover::Unreadable => {}
    }
    // Only the record we read: whoever wrote since decides again.
    let replace = Txn::new()
        .when([Compare::mod_revision(key, CompareOp::Equal, revision)])
        .and_then([put()]);
    if timed("register", client.txn(replace)).await?.succeeded() {
        Ok(())
    } else {
        Err(MembershipError::Raced)
    }
}

async fn timed<T>(
    what: &'static str,
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, MembershipError> {
    tokio::time::timeout(CALL_TIMEOUT, f)
        .await
        .map_err(|_| MembershipError::Timeout { what })?
        .map_err(MembershipError::from)
}

/// One connection to etcd: register, read the prefix, then watch it and
/// renew the lease until something fails.
async fn session(inner: &Inner, retry: &mut Duration) -> Result<(), MembershipError> {
    let config = &inner.config;
    let mut options = ConnectOptions::new()
        .with_connect_timeout(CALL_TIMEOUT)
        .with_timeout(CALL_TIMEOUT)
        .with_keep_alive(Duration::from_secs(2), CALL_TIMEOUT);
    if let Some(tls) = &config.tls {
        options = options.with_tls(tls.options());
    }
    let mut client = timed("connect", Client::connect(&config.endpoints, Some(options))).await?;
    let ttl = config.lease_ttl_s as i64;
    let lease = timed("lease grant", client.lease_grant(ttl, None))
        .await?
        .id();
    let key = node_key(&config.prefix, &config.record.node);
    register(&mut client, &key, &config.record, lease).await?;
    let (mut keeper, mut renewals) =
        timed("lease keep-alive", client.lease_keep_alive(lease)).await?;
    let prefix = nodes_prefix(&config.prefix);
    let snapshot = timed(
        "read members",
        client.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let revision = snapshot.header().map(|h| h.revision()).unwrap_or(0);
    let records = snapshot
        .kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.value().to_vec(),
                kv.mod_revision(),
            )
        })
        .collect();
    let changes = lock(&inner.view).resync(records, revision);
    for change in changes {
        inner.emit(Some(change));
    }
    let mut watch = timed(
        "watch",
        client.watch(
            prefix,
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        ),
    )
    .await?;
    *lock(&inner.client) = Some(client.clone());
    m::membership_connected().set(1.0);
    m::membership_peers().set(lock(&inner.view).len() as f64);
    info!(
        endpoints = ?config.endpoints,
        prefix = %config.prefix,
        peers = lock(&inner.view).len(),
        lease_ttl_s = ttl,
        "membership: registered in etcd"
    );
    *retry = RETRY_MIN;
    // Renewed three times a lease: one late renewal does not drop us.
    let mut renew = tokio::time::interval(Duration::from_secs(ttl.max(3) as u64) / 3);
    loop {
        tokio::select! {
            _ = renew.tick() => {
                timed("lease renewal", keeper.keep_alive()).await?;
            }
            renewed = renewals.message() => {
                match renewed? {
                    Some(r) if r.ttl() > 0 => {}
                    Some(_) => return Err(MembershipError::LeaseExpired),
                    None => return Err(MembershipError::StreamEnded("lease keep-alive")),
                }
            }
            event = watch.message() => {
                let Some(resp) = event? else {
                    return Err(MembershipError::StreamEnded("watch"));
                };
                on_watch(inner, resp)?;
            }
        }
    }
}

fn on_watch(inner: &Inner, resp: WatchResponse) -> Result<(), MembershipError> {
    if resp.canceled() {
        // Compacted past our revision, or cancelled by the server: a new
        // session reads the whole prefix again (resync finds who left).
        return Err(MembershipError::WatchCancelled(
            resp.cancel_reason().to_string(),
        ));
    }
    let own = node_key(&inner.config.prefix, &inner.config.record.node);
    for event in resp.events() {
        let Some(kv) = event.kv() else { continue };
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        if key == own && event.event_type() == EventType::Delete {
            // Deleted by hand (or its lease revoked): peers would drop us.
            return Err(MembershipError::RecordDeleted);
        }
        let store_event = match event.event_type() {
            EventType::Put => StoreEvent::Put {
                key,
                value: kv.value().to_vec(),
                revision: kv.mod_revision(),
            },
            EventType::Delete => StoreEvent::Delete {
                key,
                revision: kv.mod_revision(),
            },
        };
        let change = lock(&inner.view).apply(store_event);
        inner.emit(change);
    }
    m::membership_peers().set(lock(&inner.view).len() as f64);
    Ok(())
}
