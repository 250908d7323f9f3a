//! Pieces shared by the in-memory session tests: regions as plain byte vectors.

use std::collections::HashMap;

use std::time::Instant;

use crate::layout::RegionLayout;
use crate::plan::BlockSelection;
use crate::session::{ConnId, RegionAccess, RegionDirectory, Session, SliceDisposition, Transmit};
use crate::wire::{pb, Body, SliceHeader};

/// What a test wire carries: a control message, or a slice with its payload.
pub enum Item {
    Control(Body),
    Slice(SliceHeader, Vec<u8>),
}

pub struct Region {
    pub layout: RegionLayout,
    pub bytes: Vec<u8>,
    pub exposed: bool,
    /// One-sided keys the region grants (none: two-sided only).
    pub keys: Vec<pb::MemoryKey>,
    /// Each block's generation (1 until released).
    pub generations: Vec<u64>,
}

#[derive(Default)]
pub struct Regions(pub HashMap<u64, Region>);

impl Regions {
    /// A region filled with [`pattern`] (a source) or zeros (a destination).
    pub fn add(&mut self, id: u64, layout: RegionLayout, fill: bool, exposed: bool) {
        let len = layout.extent() as usize;
        let bytes = if fill { pattern(id, len) } else { vec![0; len] };
        self.0.insert(
            id,
            Region {
                layout,
                bytes,
                exposed,
                keys: Vec::new(),
                generations: vec![1; layout.num_blocks as usize],
            },
        );
    }

    /// The worker released `blocks`: their generations move on.
    pub fn release(&mut self, id: u64, blocks: &[u32]) {
        let r = self.0.get_mut(&id).unwrap();
        for &b in blocks {
            r.generations[b as usize] += 1;
        }
    }

    /// Lets peers reach region `id` one-sided on `rails` (offsets are addresses, rkey = id).
    pub fn grant_rails(&mut self, id: u64, rails: &[u32]) {
        let r = self.0.get_mut(&id).unwrap();
        r.keys = rails
            .iter()
            .map(|&rail| pb::MemoryKey {
                rail_index: rail,
                addr: 0,
                length: r.bytes.len() as u64,
                rkey: id as u32,
            })
            .collect();
    }

    /// A transmit as it goes on the wire: its connection, and the item with the
    /// slice's pieces gathered from the source region.
    pub fn wire_item(&self, t: Transmit) -> (ConnId, Item) {
        match t {
            Transmit::Control { conn, msg } => (conn, Item::Control(msg.body.unwrap())),
            Transmit::Slice {
                conn,
                header,
                len,
                region_id,
                pieces,
                ..
            } => {
                let data = gather(&self.0[&region_id].bytes, &pieces);
                assert_eq!(data.len(), len as usize);
                (conn, Item::Slice(header, data))
            }
        }
    }
}

/// The bytes of `pieces` (offset, len) of `src`, in order.
pub fn gather(src: &[u8], pieces: &[(u64, u64)]) -> Vec<u8> {
    let mut data = Vec::new();
    for &(off, l) in pieces {
        data.extend_from_slice(&src[off as usize..(off + l) as usize]);
    }
    data
}

/// Writes `data` into `pieces` of `dst`, in order; the lengths must match.
pub fn scatter(dst: &mut [u8], pieces: &[(u64, u64)], data: &[u8]) {
    let mut cursor = 0usize;
    for &(off, l) in pieces {
        dst[off as usize..(off + l) as usize].copy_from_slice(&data[cursor..cursor + l as usize]);
        cursor += l as usize;
    }
    assert_eq!(cursor, data.len());
}

/// Hands an item that arrived on `conn` to `session`, as a driver does: control
/// messages go in, slice payloads are scattered where the session says.
pub fn deliver(
    session: &mut Session,
    regions: &mut Regions,
    conn: ConnId,
    item: Item,
    now: Instant,
) {
    match item {
        Item::Control(body) => session.handle_control(conn, body, now, regions),
        Item::Slice(header, data) => {
            let len = data.len() as u32;
            if let SliceDisposition::Place { region_id, pieces } =
                session.accept_slice(conn, header, len, now)
            {
                scatter(
                    &mut regions.0.get_mut(&region_id).unwrap().bytes,
                    &pieces,
                    &data,
                );
                session.slice_placed(conn, header, len, now);
            }
        }
    }
}

impl RegionDirectory for Regions {
    fn lookup(&self, region_id: u64) -> Option<RegionAccess> {
        self.0.get(&region_id).map(|r| RegionAccess {
            layout: r.layout,
            exposed: r.exposed,
            keys: r.keys.clone(),
        })
    }

    fn check_generations(&self, selection: &BlockSelection) -> Result<(), String> {
        let Some(r) = self.0.get(&selection.region_id) else {
            return Ok(());
        };
        selection.check_generations(|b| r.generations.get(b as usize).copied())
    }
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(31).wrapping_add(seed * 7) % 251) as u8 + 1)
        .collect()
}

pub fn sel(region: u64, layers: (u32, u32), blocks: &[u32]) -> BlockSelection {
    BlockSelection {
        region_id: region,
        layer_start: layers.0,
        layer_count: layers.1,
        block_ids: blocks.to_vec(),
        generations: Vec::new(),
    }
}
