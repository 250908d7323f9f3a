//! A stream connection's reader and writer tasks on a thread of their own.
//!
//! On the shared runtime a frame's arrival wakes whichever worker polls
//! `epoll`; the reader task then waits in that worker's queue until a
//! sibling is woken to steal it, one sibling at a time (traced on 16 cores:
//! a striped push's readers started 50-100 us apart, and a small push's
//! reader stopped 10-46 us between two sub-microsecond steps). A connection
//! on its own thread has its socket registered with that thread's
//! single-threaded runtime: the kernel wakes the thread that reads, and a
//! frame queued for the writer wakes the thread that writes.
//!
//! Everything else the tasks do runs as if on the shared runtime (its
//! handle is entered around every poll and drop): tasks they spawn, timers
//! and other sockets they register belong to the runtime that outlives the
//! connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use kvrail_transport::Connection;
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::{AbortHandle, JoinHandle};

/// Threads of connections alive in this process.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Most connection threads at once, per CPU; connections past it run on
/// the shared runtime.
const THREADS_PER_CPU: usize = 4;

fn thread_limit() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus * THREADS_PER_CPU
}

/// A connection's own thread, started and waiting for its tasks.
pub(super) struct OwnThread {
    runtime: Handle,
    start: oneshot::Sender<(JoinHandle<()>, JoinHandle<()>)>,
}

impl OwnThread {
    /// Starts a thread for `conn` and moves its socket there: `None` (and
    /// `conn` where it was) when the transport cannot move, the process has
    /// its share of connection threads, or the thread cannot start.
    pub(super) fn start_for(conn: &mut Connection, peer: &str) -> Option<OwnThread> {
        let shared = Handle::try_current().ok()?;
        if LIVE.fetch_add(1, Ordering::AcqRel) >= thread_limit() {
            LIVE.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        // From here the count is the thread's to give back (or
        // `spawn_thread`'s, if no thread starts).
        let (handle, start) = Self::spawn_thread(&shared, peer)?;
        let moved = {
            let _here = handle.enter();
            conn.move_to_current_runtime()
        };
        match moved {
            Ok(true) => Some(OwnThread {
                runtime: handle,
                start,
            }),
            // The thread ends when `start` is dropped unsent.
            Ok(false) => None,
            Err(e) => {
                tracing::warn!(%peer, "moving a connection to its own thread: {e}; it runs on the shared runtime");
                None
            }
        }
    }

    /// A thread with a runtime of its own (built there: a runtime may not be
    /// dropped where the caller runs, inside the shared one), waiting for
    /// its two tasks.
    #[allow(clippy::type_complexity)]
    fn spawn_thread(
        shared: &Handle,
        peer: &str,
    ) -> Option<(Handle, oneshot::Sender<(JoinHandle<()>, JoinHandle<()>)>)> {
        let (start, started) = oneshot::channel::<(JoinHandle<()>, JoinHandle<()>)>();
        // The shared runtime's end ends the thread too (its tasks would
        // otherwise keep the connection open after the daemon stopped).
        let (mut keep, shared_gone) = oneshot::channel::<()>();
        let (built, runtime_of) = std::sync::mpsc::sync_channel::<Option<Handle>>(1);
        let who = peer.to_string();
        let spawned = std::thread::Builder::new()
            .name("kvrail-conn".into())
            .spawn(move || {
                struct Leave;
                impl Drop for Leave {
                    fn drop(&mut self) {
                        LIVE.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                let _leave = Leave;
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::warn!(peer = %who, "a connection's own runtime: {e}; it runs on the shared one");
                        let _ = built.send(None);
                        return;
                    }
                };
                let _ = built.send(Some(runtime.handle().clone()));
                runtime.block_on(async move {
                    let Ok((reader, writer)) = started.await else {
                        return;
                    };
                    let stop = [reader.abort_handle(), writer.abort_handle()];
                    tokio::select! {
                        () = run_both(reader, writer) => {}
                        _ = shared_gone => stop.iter().for_each(AbortHandle::abort),
                    }
                });
                // Dropping the runtime drops what is left of the tasks, with
                // the shared runtime entered (see `OnShared`).
            });
        if let Err(e) = spawned {
            LIVE.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(%peer, "a connection's own thread: {e}; it runs on the shared runtime");
            return None;
        }
        // Tens of microseconds, once per connection. None: the thread has
        // ended and given its count back.
        let handle = runtime_of.recv().ok().flatten()?;
        shared.spawn(async move { keep.closed().await });
        Some((handle, start))
    }

    /// Runs `reader` and `writer` on the thread; their abort handles.
    pub(super) fn run(
        self,
        reader: impl Future<Output = ()> + Send + 'static,
        writer: impl Future<Output = ()> + Send + 'static,
    ) -> (AbortHandle, AbortHandle) {
        let shared = Handle::current();
        let reader = self.runtime.spawn(OnShared::new(shared.clone(), reader));
        let writer = self.runtime.spawn(OnShared::new(shared, writer));
        let handles = (reader.abort_handle(), writer.abort_handle());
        if let Err((reader, writer)) = self.start.send((reader, writer)) {
            // The thread is gone (it never is before this): the connection
            // ends, and its reader's report with it.
            reader.abort();
            writer.abort();
        }
        handles
    }
}

/// Waits for a connection's reader and writer. One that panicked never
/// reported its connection lost: the other is stopped with it, rather than
/// left holding the thread until the link closes.
async fn run_both(mut reader: JoinHandle<()>, mut writer: JoinHandle<()>) {
    let stop = [reader.abort_handle(), writer.abort_handle()];
    let panicked = tokio::select! {
        r = &mut reader => r.is_err_and(|e| e.is_panic()),
        w = &mut writer => w.is_err_and(|e| e.is_panic()),
    };
    if panicked {
        stop.iter().for_each(AbortHandle::abort);
    }
    // The one that ended was taken above; a finished handle is not polled again.
    for task in [reader, writer] {
        if !task.is_finished() {
            let _ = task.await;
        }
    }
}

/// A future polled, and dropped, with the shared runtime entered.
struct OnShared<F> {
    shared: Handle,
    inner: Option<Pin<Box<F>>>,
}

impl<F> OnShared<F> {
    fn new(shared: Handle, inner: F) -> Self {
        Self {
            shared,
            inner: Some(Box::pin(inner)),
        }
    }
}

impl<F: Future> Future for OnShared<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _shared = self.shared.enter();
        match self.inner.as_mut() {
            Some(inner) => inner.as_mut().poll(cx),
            None => Poll::Pending,
        }
    }
}

impl<F> Drop for OnShared<F> {
    fn drop(&mut self) {
        let _shared = self.shared.enter();
        self.inner.take();
    }
}
