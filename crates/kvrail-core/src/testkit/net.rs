//! The one simulated network every in-memory session test drives: two
//! sessions, connections grouped into rails, a clock, and the knobs (rate,
//! latency, jitter, loss, cuts, a paused side) in one place.
//!
//! Each connection is a FIFO per direction whose items carry their arrival
//! time; [`Net::step`] delivers the earliest. A rail serialises what its
//! connections send at its rate, adds its latency, a seeded random jitter
//! (which reorders items across connections, never within one) and, for a
//! lost item, a retransmission timeout. One-sided connections carry posted
//! work that the net executes on arrival as a NIC would: a copy between the
//! two sides' regions, refused outside the granted key.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{deliver, deliver_through_gates, gather, scatter, Item, Regions};
use crate::placement::ConnPlacer;
use crate::rail::{RailHealth, RailId};
use crate::session::{
    ConnId, Event, OneSidedOp, RemoteSlice, Session, SessionConfig, SliceDisposition, Transmit,
};
use crate::wire::{Body, SliceHeader};

/// One endpoint: its session, its regions and what it reported.
pub struct Side {
    pub session: Session,
    pub regions: Regions,
    pub events: Vec<Event>,
    /// When each of `events` was reported (since the net started).
    pub event_times: Vec<Duration>,
}

impl Side {
    fn new(config: SessionConfig) -> Self {
        Side {
            session: Session::new(config),
            regions: Regions::default(),
            events: Vec::new(),
            event_times: Vec::new(),
        }
    }

    /// Events with the time each was reported.
    pub fn timed_events(&self) -> impl Iterator<Item = (Duration, &Event)> {
        self.event_times.iter().copied().zip(&self.events)
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        super::assert_lifecycle_kept(&self.session);
    }
}

/// How a rail carries items (both directions alike).
#[derive(Debug, Clone, Copy)]
pub struct RailSpec {
    /// Bytes per second; infinite: items take no time on the wire.
    pub rate: f64,
    pub latency: Duration,
    /// Up to this much more latency per item, drawn from the net's seed.
    pub jitter: Duration,
    /// Chance that an item is lost once and arrives [`RTO`] late.
    pub loss: f64,
}

impl RailSpec {
    /// Items arrive in a random order across connections (per-connection
    /// order kept) and take no simulated time to speak of.
    pub fn shuffling() -> Self {
        RailSpec {
            rate: f64::INFINITY,
            latency: Duration::from_micros(1),
            jitter: Duration::from_micros(50),
            loss: 0.0,
        }
    }

    /// `rate_mb` MB/s with 50 us of latency.
    pub fn rated(rate_mb: f64) -> Self {
        RailSpec {
            rate: rate_mb * 1e6,
            latency: Duration::from_micros(50),
            jitter: Duration::ZERO,
            loss: 0.0,
        }
    }
}

/// A retransmission timeout, for items the loss model drops once.
pub const RTO: Duration = Duration::from_millis(200);

/// How a rail dies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// Everything on it vanishes and nobody is told (a 100% drop qdisc, a cable pulled).
    BlackHole,
    /// Its connections break with an error on both sides (a reset, a port flap).
    Reset,
}

#[derive(Debug, Clone, Copy)]
pub enum RailAction {
    Cut(Fault),
    Restore,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LinkKind {
    /// Two-sided: control messages and slices with their payload.
    Stream,
    /// A queue pair: slices posted one-sided.
    OneSided,
}

/// A connection: its id and whether it is open, on each side (a side that
/// closed its end over a dead rail leaves the other end open and unaware).
pub struct Link {
    pub rail: RailId,
    pub kind: LinkKind,
    pub ids: [ConnId; 2],
    pub open: [bool; 2],
}

/// One-sided work posted by side `from`.
pub struct Posted {
    pub from: usize,
    pub header: SliceHeader,
    pub len: u32,
    pub region_id: u64,
    pub pieces: Vec<(u64, u64)>,
    pub remote: RemoteSlice,
}

enum Cargo {
    Item(Item),
    Posted(Posted),
}

struct Timed {
    at: Instant,
    seq: u64,
    cargo: Cargo,
}

/// One direction of a connection: what is in flight, in order.
#[derive(Default)]
pub struct Wire(VecDeque<Timed>);

impl Wire {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Items in flight.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Takes the stream item at `index` (of [`Wire::iter`]'s order) off the wire.
    pub fn remove(&mut self, index: usize) -> Option<Item> {
        let at = self
            .0
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(t.cargo, Cargo::Item(_)))
            .nth(index)?
            .0;
        match self.0.remove(at)?.cargo {
            Cargo::Item(item) => Some(item),
            Cargo::Posted(_) => None,
        }
    }

    /// Loses everything in flight.
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Takes the next stream item off the wire, undelivered.
    pub fn pop_front(&mut self) -> Option<Item> {
        match self.0.pop_front()?.cargo {
            Cargo::Item(item) => Some(item),
            Cargo::Posted(_) => panic!("one-sided work is not a stream item"),
        }
    }

    /// The stream items in flight.
    pub fn iter(&self) -> impl Iterator<Item = &Item> {
        self.0.iter().filter_map(|t| match &t.cargo {
            Cargo::Item(i) => Some(i),
            Cargo::Posted(_) => None,
        })
    }

    /// The one-sided work in flight.
    pub fn posted(&self) -> impl Iterator<Item = &Posted> {
        self.0.iter().filter_map(|t| match &t.cargo {
            Cargo::Posted(p) => Some(p),
            Cargo::Item(_) => None,
        })
    }

    /// Loses the stream items `keep` refuses.
    pub fn retain(&mut self, mut keep: impl FnMut(&Item) -> bool) {
        self.0.retain(|t| match &t.cargo {
            Cargo::Item(i) => keep(i),
            Cargo::Posted(_) => true,
        });
    }
}

/// What crossed the net.
#[derive(Default)]
pub struct Stats {
    /// Two-sided slices sent per link.
    pub slices_per_link: Vec<usize>,
    /// Payload length of every two-sided slice sent, per direction (0: side 0 to 1).
    pub slice_lens: [Vec<usize>; 2],
    /// Slices a receiver's gate placed (with gates).
    pub admitted_by_gates: usize,
    pub one_sided_writes: usize,
    pub one_sided_reads: usize,
    /// Grant messages sent (either way).
    pub grants: usize,
    /// Bytes of one-sided work outside a granted key (refused: must stay 0).
    pub out_of_bounds: usize,
}

impl Stats {
    pub fn two_sided_slices(&self) -> usize {
        self.slices_per_link.iter().sum()
    }
}

/// Two sessions on a simulated network. Side 0 dialed (it probes rails back).
pub struct Net {
    pub sides: [Side; 2],
    pub links: Vec<Link>,
    /// Per link, per direction (0: side 0 to side 1).
    pub wires: Vec<[Wire; 2]>,
    specs: Vec<RailSpec>,
    pub rail_up: Vec<bool>,
    /// When each rail's sender, per direction, finishes its current item.
    rail_free: Vec<[Instant; 2]>,
    seq: u64,
    pub start: Instant,
    pub now: Instant,
    rng: StdRng,
    script: VecDeque<(Instant, RailId, RailAction)>,
    /// Side 1 is stopped (SIGSTOP, a GC pause, CPU starvation) until then: it
    /// reads, sends and times out nothing; what arrives waits for it.
    paused_until: Option<Instant>,
    /// Some: receivers place slices through gates, one placer per link and side.
    placers: Option<Vec<[ConnPlacer; 2]>>,
    pub stats: Stats,
    next_transfer: u64,
    /// Stream connections a probe that succeeds opens on its rail.
    conns_per_rail: usize,
    /// Side 0's probes of down rails are answered (a rail up again gets new
    /// connections); otherwise they go unanswered, as if no dialer ran.
    pub answer_probes: bool,
    /// A side that reports a rail down closes its connections there, as the
    /// sidecar does (the peer hears of it if the rail still carries packets).
    pub close_down_rails: bool,
}

impl Net {
    /// Two sessions with `configs`, rails as `specs` (no connections yet), and
    /// everything random drawn from `seed`.
    pub fn new(configs: [SessionConfig; 2], specs: &[RailSpec], seed: u64) -> Self {
        let start = Instant::now();
        let [a, b] = configs;
        Net {
            sides: [Side::new(a), Side::new(b)],
            links: Vec::new(),
            wires: Vec::new(),
            specs: specs.to_vec(),
            rail_up: vec![true; specs.len()],
            rail_free: vec![[start; 2]; specs.len()],
            seq: 0,
            start,
            now: start,
            rng: StdRng::seed_from_u64(seed),
            script: VecDeque::new(),
            paused_until: None,
            placers: None,
            stats: Stats::default(),
            next_transfer: 1,
            conns_per_rail: 1,
            answer_probes: false,
            close_down_rails: false,
        }
    }

    /// Receivers place slices through gates (as the sidecar's readers do).
    pub fn place_through_gates(&mut self) {
        self.placers = Some(Vec::new());
    }

    pub fn through_gates(&self) -> bool {
        self.placers.is_some()
    }

    /// A fresh transfer id.
    pub fn next_transfer_id(&mut self) -> u64 {
        let id = self.next_transfer;
        self.next_transfer += 1;
        id
    }

    pub fn elapsed(&self) -> Duration {
        self.now - self.start
    }

    /// Opens a connection on `rail` on both sides; its link index.
    pub fn connect(&mut self, rail: RailId, kind: LinkKind) -> usize {
        let now = self.now;
        let open = |s: &mut Side| match kind {
            LinkKind::Stream => s.session.add_connection(rail, now),
            LinkKind::OneSided => s.session.add_one_sided_connection(rail, now),
        };
        let a = open(&mut self.sides[0]).expect("side 0 takes the connection");
        let b = open(&mut self.sides[1]).expect("side 1 takes the connection");
        self.links.push(Link {
            rail,
            kind,
            ids: [a, b],
            open: [true; 2],
        });
        self.wires.push(Default::default());
        self.stats.slices_per_link.push(0);
        self.links.len() - 1
    }

    /// Opens `per_rail` stream connections on every rail (and as many again
    /// on a rail whose probe succeeds).
    pub fn connect_rails(&mut self, per_rail: usize) {
        self.conns_per_rail = per_rail;
        for rail in 0..self.specs.len() {
            for _ in 0..per_rail {
                self.connect(rail as RailId, LinkKind::Stream);
            }
        }
    }

    /// The link side `side` knows as `conn`.
    pub fn link_of(&self, side: usize, conn: ConnId) -> usize {
        self.links
            .iter()
            .position(|l| l.open[side] && l.ids[side] == conn)
            .unwrap_or_else(|| panic!("side {side} wrote on closed connection {conn}"))
    }

    /// Schedules `action` on `rail`, `after` the net started.
    pub fn at(&mut self, after: Duration, rail: RailId, action: RailAction) {
        self.script.push_back((self.start + after, rail, action));
        self.script.make_contiguous().sort_by_key(|s| s.0);
    }

    /// Stops side 1 for `pause`, from now.
    pub fn pause_receiver(&mut self, pause: Duration) {
        self.paused_until = Some(self.now + pause);
    }

    /// Whether `side` is stopped now (only side 1 ever is).
    pub fn is_paused(&self, side: usize) -> bool {
        side == 1 && self.paused_until.is_some_and(|t| self.now < t)
    }

    fn send(&mut self, link: usize, dir: usize, cargo: Cargo, len: usize) {
        let rail = self.links[link].rail as usize;
        if !self.rail_up[rail] || !self.links[link].open[1 - dir] {
            return; // into the void
        }
        let spec = self.specs[rail];
        let mut done = self.now;
        if spec.rate.is_finite() {
            done = self.rail_free[rail][dir].max(self.now)
                + Duration::from_secs_f64(len as f64 / spec.rate);
            self.rail_free[rail][dir] = done;
        }
        let mut arrival = done + spec.latency;
        if !spec.jitter.is_zero() {
            arrival += spec.jitter.mul_f64(self.rng.random::<f64>());
        }
        if spec.loss > 0.0 && self.rng.random_bool(spec.loss) {
            arrival += RTO;
        }
        // A connection delivers in order.
        let wire = &mut self.wires[link][dir].0;
        if let Some(last) = wire.back() {
            arrival = arrival.max(last.at);
        }
        self.seq += 1;
        wire.push_back(Timed {
            at: arrival,
            seq: self.seq,
            cargo,
        });
    }

    /// Drains both sessions until quiet: transmits onto the wires, events into
    /// the logs, probes into new connections.
    pub fn flush(&mut self) {
        while self.flush_once() {}
    }

    fn flush_once(&mut self) -> bool {
        let mut busy = false;
        for dir in 0..2 {
            if self.is_paused(dir) {
                continue;
            }
            while let Some(t) = self.sides[dir].session.poll_transmit(self.now) {
                busy = true;
                self.transmit(dir, t);
            }
            while let Some(e) = self.sides[dir].session.poll_event() {
                busy = true;
                if let Event::Rail(c) = &e {
                    if c.to == RailHealth::Down && self.close_down_rails {
                        self.close_rail(dir, c.rail);
                    }
                }
                let at = self.elapsed();
                self.sides[dir].events.push(e);
                self.sides[dir].event_times.push(at);
            }
        }
        while self.answer_probes {
            let Some(rail) = self.sides[0].session.poll_probe() else {
                break;
            };
            busy = true;
            // A stopped acceptor completes no handshake.
            if self.rail_up[rail as usize] && !self.is_paused(1) {
                // The acceptor replaces whatever it still holds on that rail.
                for conn in self.sides[1].session.retire_rail_connections(rail) {
                    let link = self.link_of(1, conn);
                    self.links[link].open[1] = false;
                }
                for _ in 0..self.conns_per_rail {
                    self.connect(rail, LinkKind::Stream);
                }
            } else {
                let now = self.now;
                self.sides[0]
                    .session
                    .probe_failed(rail, "connection refused", now);
            }
        }
        busy
    }

    fn transmit(&mut self, dir: usize, t: Transmit) {
        if let Transmit::Slice {
            conn,
            header,
            len,
            region_id,
            pieces,
            remote: Some(remote),
            ..
        } = t
        {
            let link = self.link_of(dir, conn);
            assert_eq!(
                self.links[link].kind,
                LinkKind::OneSided,
                "one-sided slice on a stream connection"
            );
            match remote.op {
                OneSidedOp::Write => self.stats.one_sided_writes += 1,
                OneSidedOp::Read => self.stats.one_sided_reads += 1,
            }
            let posted = Posted {
                from: dir,
                header,
                len,
                region_id,
                pieces,
                remote,
            };
            self.send(link, dir, Cargo::Posted(posted), len as usize + 24);
            return;
        }
        let (conn, item) = self.sides[dir].regions.wire_item(t);
        let link = self.link_of(dir, conn);
        assert_eq!(
            self.links[link].kind,
            LinkKind::Stream,
            "stream traffic on a queue pair"
        );
        let len = match &item {
            Item::Slice(_, payload) => {
                self.stats.slices_per_link[link] += 1;
                self.stats.slice_lens[dir].push(payload.len());
                payload.len() + 24
            }
            Item::Control(body) => {
                if matches!(body, Body::Grant(_)) {
                    self.stats.grants += 1;
                }
                64
            }
        };
        self.send(link, dir, Cargo::Item(item), len);
    }

    /// Side `side` closed its connections on `rail`; the other side hears of it
    /// only if the rail still carries packets.
    fn close_rail(&mut self, side: usize, rail: RailId) {
        for i in 0..self.links.len() {
            let l = &mut self.links[i];
            if l.open[side] && l.rail == rail {
                l.open[side] = false;
                if self.rail_up[rail as usize] && l.open[1 - side] {
                    l.open[1 - side] = false;
                    let other = l.ids[1 - side];
                    let now = self.now;
                    self.sides[1 - side]
                        .session
                        .connection_lost(other, "peer closed", now);
                }
            }
        }
    }

    /// Both ends of `link` break with an error; what was in flight on it is
    /// lost (posted one-sided work included).
    pub fn kill(&mut self, link: usize, reason: &str) {
        for dir in 0..2 {
            self.wires[link][dir].clear();
        }
        let now = self.now;
        for side in 0..2 {
            if !self.links[link].open[side] {
                continue;
            }
            self.links[link].open[side] = false;
            let id = self.links[link].ids[side];
            self.sides[side].session.connection_lost(id, reason, now);
        }
        // A dead connection's reader merges what it placed in full when it
        // stops, after the session has heard of the loss.
        if let Some(placers) = self.placers.as_mut().and_then(|p| p.get_mut(link)) {
            for (side, placer) in placers.iter_mut().enumerate() {
                let id = self.links[link].ids[side];
                self.sides[side]
                    .session
                    .merge_placed(Some(id), placer.take_placed(), now);
            }
        }
    }

    fn apply(&mut self, rail: RailId, action: RailAction) {
        match action {
            RailAction::Cut(fault) => {
                self.rail_up[rail as usize] = false;
                if fault == Fault::Reset {
                    for link in 0..self.links.len() {
                        if self.links[link].rail == rail {
                            self.kill(link, "connection reset");
                        }
                    }
                }
            }
            RailAction::Restore => self.rail_up[rail as usize] = true,
        }
    }

    /// The wire whose next item arrives first (earliest sent on ties), among
    /// those `kinds` admits and whose receiver runs.
    fn next_wire(&self, kinds: Option<LinkKind>) -> Option<(Instant, usize, usize)> {
        let mut best: Option<(Instant, u64, usize, usize)> = None;
        for (link, wires) in self.wires.iter().enumerate() {
            if kinds.is_some_and(|k| k != self.links[link].kind) {
                continue;
            }
            for (dir, wire) in wires.iter().enumerate() {
                if let Some(t) = wire.0.front() {
                    let at = match self.paused_until {
                        // Waits for the stopped side to run again.
                        Some(p) if dir == 0 && t.at < p => p,
                        _ => t.at,
                    };
                    if best.is_none_or(|b| (at, t.seq) < (b.0, b.1)) {
                        best = Some((at, t.seq, link, dir));
                    }
                }
            }
        }
        best.map(|(at, _, link, dir)| (at, link, dir))
    }

    /// Delivers the next item to arrive (the clock moves to its arrival);
    /// false when nothing is in flight. Timers do not run (see [`Net::run_until`]).
    pub fn step(&mut self) -> bool {
        self.step_kind(None)
    }

    /// As [`Net::step`], on links of `kind` only.
    pub fn step_kind(&mut self, kind: Option<LinkKind>) -> bool {
        self.flush();
        let Some((at, link, dir)) = self.next_wire(kind) else {
            return false;
        };
        self.now = self.now.max(at);
        self.arrive(link, dir);
        self.flush();
        true
    }

    /// Delivers the next item on `link` in direction `dir` now, whenever it
    /// was due.
    pub fn arrive(&mut self, link: usize, dir: usize) {
        let Some(timed) = self.wires[link][dir].0.pop_front() else {
            return;
        };
        let l = &self.links[link];
        if !l.open[1 - dir] || !self.rail_up[l.rail as usize] {
            return;
        }
        let to = 1 - dir;
        let conn = l.ids[to];
        match timed.cargo {
            Cargo::Item(item) => {
                let more_input = !self.wires[link][dir].is_empty();
                let side = &mut self.sides[to];
                match &mut self.placers {
                    Some(placers) => {
                        if placers.len() <= link {
                            placers.resize_with(link + 1, Default::default);
                        }
                        let placer = &mut placers[link][to];
                        self.stats.admitted_by_gates += usize::from(deliver_through_gates(
                            &mut side.session,
                            &mut side.regions,
                            placer,
                            conn,
                            item,
                            more_input,
                            self.now,
                        ));
                    }
                    None => deliver(&mut side.session, &mut side.regions, conn, item, self.now),
                }
            }
            Cargo::Posted(p) => {
                let (from, header, len, op) = (p.from, p.header, p.len, p.remote.op);
                let conn_from = self.links[link].ids[from];
                // Out of bounds, nothing is copied (and it is counted).
                self.execute(p);
                if op == OneSidedOp::Write {
                    let peer = &mut self.sides[1 - from];
                    if let SliceDisposition::Place { .. } =
                        peer.session.accept_slice(conn, header, len, self.now)
                    {
                        peer.session.slice_placed(conn, header, len, self.now);
                    }
                }
                self.sides[from]
                    .session
                    .one_sided_done(conn_from, header, len, self.now);
            }
        }
    }

    /// Copies a slice between the two regions as a NIC would: the remote
    /// pieces must lie inside the granted key, or nothing is copied (and the
    /// bytes are counted).
    fn execute(&mut self, p: Posted) {
        let (me, peer) = (p.from, 1 - p.from);
        let key = &p.remote.key;
        let outside: u64 = p
            .remote
            .pieces
            .iter()
            .filter(|&&(off, l)| off < key.addr || off + l > key.addr + key.length)
            .map(|p| p.1)
            .sum();
        if outside > 0 {
            self.stats.out_of_bounds += outside as usize;
            return;
        }
        let remote_region = u64::from(key.rkey);
        let ((src_side, src_region, src_pieces), (dst_side, dst_region, dst_pieces)) =
            match p.remote.op {
                OneSidedOp::Write => (
                    (me, p.region_id, &p.pieces),
                    (peer, remote_region, &p.remote.pieces),
                ),
                OneSidedOp::Read => (
                    (peer, remote_region, &p.remote.pieces),
                    (me, p.region_id, &p.pieces),
                ),
            };
        let data = gather(
            &self.sides[src_side].regions.0[&src_region].bytes,
            src_pieces,
        );
        let dst = &mut self.sides[dst_side]
            .regions
            .0
            .get_mut(&dst_region)
            .expect("the key names a region")
            .bytes;
        scatter(dst, dst_pieces, &data);
    }

    /// Delivers until nothing is in flight (timers do not run).
    pub fn drive(&mut self) {
        let mut steps = 0;
        while self.step() {
            steps += 1;
            assert!(steps < 1_000_000, "the net did not go idle");
        }
        if self.placers.is_some() && self.stats.two_sided_slices() > 0 {
            assert!(
                self.stats.admitted_by_gates > 0,
                "no slice went through a gate"
            );
        }
    }

    /// Runs until `done` holds or `limit` of simulated time passes: arrivals,
    /// timers and the script, in time order.
    pub fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&Net) -> bool) {
        let end = self.start + limit;
        loop {
            self.flush();
            if done(self) {
                return;
            }
            let paused = self.paused_until.filter(|t| self.now < *t);
            let next = [
                self.next_wire(None).map(|n| n.0),
                self.sides[0].session.poll_timeout(),
                self.sides[1]
                    .session
                    .poll_timeout()
                    .map(|t| paused.map_or(t, |p| t.max(p))),
                self.script.front().map(|s| s.0),
                paused,
            ]
            .into_iter()
            .flatten()
            .min();
            let Some(next) = next else {
                return;
            };
            if next > end {
                return;
            }
            self.now = self.now.max(next);
            while self.script.front().is_some_and(|s| s.0 <= self.now) {
                let (_, rail, action) = self.script.pop_front().expect("checked");
                self.apply(rail, action);
            }
            while let Some((at, link, dir)) = self.next_wire(None) {
                if at > self.now {
                    break;
                }
                self.arrive(link, dir);
                self.flush();
            }
            for side in 0..2 {
                if self.is_paused(side) {
                    continue;
                }
                if self.sides[side]
                    .session
                    .poll_timeout()
                    .is_some_and(|t| t <= self.now)
                {
                    let now = self.now;
                    self.sides[side].session.handle_timeout(now);
                }
            }
        }
    }
}
