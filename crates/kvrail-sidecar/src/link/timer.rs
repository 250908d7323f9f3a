//! The link's timer, re-armed in one place. Everything that changes a link's
//! state goes through [`Locked`]; as it is released it wakes the timer task
//! when the next deadline moved earlier than the one the task sleeps until
//! (or the link closed). Callers never re-arm the timer themselves. (The
//! wake is a `Notify` permit given while the lock is still held: the task
//! runs later and never waits on it holding the lock, so none is lost.)

use std::ops::{Deref, DerefMut};
use std::sync::MutexGuard;
use std::time::Instant;

use tokio::sync::Notify;

/// What the timer needs to know of the state it guards.
pub(super) trait Deadlines {
    /// The earliest deadline the state holds (None: none).
    fn next_deadline(&self) -> Option<Instant>;
    /// The deadline the timer task sleeps until, as it last read it (None:
    /// it sleeps until woken).
    fn armed(&self) -> Option<Instant>;
    /// Closed: the task must wake to end.
    fn closed(&self) -> bool;
}

/// Whether the timer task must wake to read the deadlines again: one due
/// later than the one it sleeps until needs no wake-up (a task wake per
/// transfer and per acknowledgement otherwise).
pub(super) fn needs_wake(state: &impl Deadlines) -> bool {
    if state.closed() {
        return true;
    }
    match (state.next_deadline(), state.armed()) {
        (Some(next), Some(armed)) => next < armed,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// The timer task's wake-up.
#[derive(Default)]
pub(super) struct Timer {
    wake: Notify,
}

impl Timer {
    /// Sleeps until `deadline` (true) or until woken (false).
    pub(super) async fn sleep_until(&self, deadline: Option<Instant>) -> bool {
        match deadline {
            Some(d) => tokio::select! {
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(d)) => true,
                _ = self.wake.notified() => false,
            },
            None => {
                self.wake.notified().await;
                false
            }
        }
    }
}

/// A link's state, locked. Reading it changes nothing; a change through it
/// (`DerefMut`) is checked against the timer when the lock is released.
pub(super) struct Locked<'a, S: Deadlines> {
    state: MutexGuard<'a, S>,
    timer: &'a Timer,
    changed: bool,
}

impl<'a, S: Deadlines> Locked<'a, S> {
    pub(super) fn new(state: MutexGuard<'a, S>, timer: &'a Timer) -> Self {
        Self {
            state,
            timer,
            changed: false,
        }
    }
}

impl<S: Deadlines> Deref for Locked<'_, S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.state
    }
}

impl<S: Deadlines> DerefMut for Locked<'_, S> {
    fn deref_mut(&mut self) -> &mut S {
        self.changed = true;
        &mut self.state
    }
}

impl<S: Deadlines> Drop for Locked<'_, S> {
    fn drop(&mut self) {
        if self.changed && needs_wake(&*self.state) {
            self.timer.wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Deadlines, Locked, Timer};
    use std::sync::Mutex;
    use std::time::Duration;
    use std::time::Instant;

    #[derive(Default)]
    struct State {
        next: Option<Instant>,
        armed: Option<Instant>,
        closed: bool,
    }

    impl Deadlines for State {
        fn next_deadline(&self) -> Option<Instant> {
            self.next
        }
        fn armed(&self) -> Option<Instant> {
            self.armed
        }
        fn closed(&self) -> bool {
            self.closed
        }
    }

    /// The timer task as a link runs it: reads the deadline, records it as
    /// armed, sleeps until it or a wake; reports each wake-up.
    async fn task(
        state: std::sync::Arc<Mutex<State>>,
        timer: std::sync::Arc<Timer>,
        woke: tokio::sync::mpsc::UnboundedSender<bool>,
    ) {
        loop {
            let deadline = {
                let mut st = state.lock().unwrap();
                if st.closed {
                    return;
                }
                st.armed = st.next;
                st.next
            };
            let reached = timer.sleep_until(deadline).await;
            if reached {
                // Handled, as the session's handle_timeout would.
                state.lock().unwrap().next = None;
            }
            if woke.send(reached).is_err() {
                return;
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_moved_earlier_wakes_the_timer_and_a_later_one_does_not() {
        let state = std::sync::Arc::new(Mutex::new(State::default()));
        let timer = std::sync::Arc::new(Timer::default());
        let (tx, mut woke) = tokio::sync::mpsc::unbounded_channel();
        let now = Instant::now();
        state.lock().unwrap().next = Some(now + Duration::from_secs(60));
        tokio::spawn(task(state.clone(), timer.clone(), tx));
        // Let the task arm itself for the 60 s deadline.
        while state.lock().unwrap().armed.is_none() {
            tokio::task::yield_now().await;
        }
        // A change that moves the deadline later: no wake-up.
        {
            let mut st = Locked::new(state.lock().unwrap(), &timer);
            st.next = Some(now + Duration::from_secs(120));
        }
        // Reading only: no wake-up either.
        {
            let st = Locked::new(state.lock().unwrap(), &timer);
            assert!(st.next.is_some());
        }
        tokio::task::yield_now().await;
        assert!(woke.try_recv().is_err(), "woken by a later deadline");
        // Earlier: the task wakes at once (paused time has not moved), not at 60 s.
        {
            let mut st = Locked::new(state.lock().unwrap(), &timer);
            st.next = Some(now + Duration::from_secs(1));
        }
        assert_eq!(woke.recv().await, Some(false), "woken, not timed out");
        assert_eq!(
            state.lock().unwrap().armed,
            Some(now + Duration::from_secs(1))
        );
        // And it then fires at the new deadline.
        assert_eq!(woke.recv().await, Some(true));
        // Closing wakes it to end.
        {
            let mut st = Locked::new(state.lock().unwrap(), &timer);
            st.closed = true;
        }
        assert_eq!(woke.recv().await, Some(false));
        assert_eq!(woke.recv().await, None, "the task ended");
    }
}
