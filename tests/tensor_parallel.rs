//! Prefill and decode sharded differently, between real sidecars over TCP:
//! every (prefill TP, decode TP) in {1,2,4,8}^2, blocks of 16 tokens on one
//! side and 64 on the other, NHD on one side and HND on the other, pushes and
//! pulls. Each emulated rank is a worker with its own region (ranks of one
//! engine share their node's sidecar); each decode rank receives the heads it
//! holds from the prefill ranks that hold them (each head once), and its
//! blocks must equal, byte for byte, the model's KV reshaped by hand into its
//! geometry. Mismatched geometries are refused before any byte moves, with a
//! message naming both sides' values (vllm#42895's block-size mismatch too).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::ops::Range;
use std::time::Duration;

use kvrail_client::proto::{BlockInterior, BlockRange, HeadSlice, KvGeometry, TransferState};
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_core::geometry::{chunk_tokens, head_sources, rank_heads};
use kvrail_e2e::Pair;

const LAYERS: u32 = 2;
const PLANES: u32 = 2;
const KV_HEADS: u32 = 8;
const HEAD_SIZE: u32 = 64;
const ELEMENT: u32 = 2;
const HEAD_BYTES: u64 = (HEAD_SIZE * ELEMENT) as u64;
/// Not a multiple of either block size: the last blocks are partial.
const TOKENS: u64 = 200;

/// One emulated rank: its shard of the KV and where its blocks are.
struct Rank {
    worker: String,
    geometry: KvGeometry,
    kv: KvRegion,
    region: u64,
    ids: Vec<u32>,
}

impl Rank {
    fn tpb(&self) -> u64 {
        u64::from(self.geometry.tokens_per_block)
    }

    fn heads(&self) -> Range<u32> {
        self.geometry.head_start..self.geometry.head_start + self.geometry.heads
    }

    fn hnd(&self) -> bool {
        self.geometry.interior == BlockInterior::Hnd as i32
    }

    /// Where (layer, plane, token, model head) starts, computed by hand.
    fn offset(&self, layer: u32, plane: u32, token: u64, head: u32) -> u64 {
        let block = self.ids[(token / self.tpb()) as usize];
        let (t, h) = (
            token % self.tpb(),
            u64::from(head - self.geometry.head_start),
        );
        let inner = if self.hnd() {
            (h * self.tpb() + t) * HEAD_BYTES
        } else {
            (t * u64::from(self.geometry.heads) + h) * HEAD_BYTES
        };
        self.kv.block_offset(layer, plane, block) + inner
    }

    fn range(&self, slice: Option<HeadSlice>) -> BlockRange {
        BlockRange {
            slice,
            ..blocks(self.region, 0..LAYERS, self.ids.clone())
        }
    }
}

/// The model's KV for one head of one token: bytes telling every coordinate apart.
fn kv_bytes(layer: u32, plane: u32, token: u64, head: u32) -> Vec<u8> {
    let seed =
        (u64::from(layer) * 7919 + u64::from(plane) * 104_729 + token * 31 + u64::from(head)) * 131;
    (0..HEAD_BYTES)
        .map(|e| ((seed + e) % 251) as u8 + 1)
        .collect()
}

#[allow(clippy::too_many_arguments)]
async fn rank(
    client: &mut Client,
    pair: &Pair,
    name: &str,
    tp: u32,
    r: u32,
    tpb: u32,
    hnd: bool,
    fill: bool,
) -> Rank {
    let heads = rank_heads(KV_HEADS, tp, r);
    let geometry = KvGeometry {
        model: "test/llama-8kv".into(),
        dtype: "bfloat16".into(),
        element_bytes: ELEMENT,
        head_size: HEAD_SIZE,
        model_kv_heads: KV_HEADS,
        head_start: heads.start,
        heads: heads.end - heads.start,
        tokens_per_block: tpb,
        interior: if hnd {
            BlockInterior::Hnd
        } else {
            BlockInterior::Nhd
        } as i32,
    };
    let blocks_needed = TOKENS.div_ceil(u64::from(tpb)) as u32;
    let block_bytes = u64::from(geometry.heads) * u64::from(tpb) * HEAD_BYTES;
    let layout = dense_layout(LAYERS, PLANES, 2 * blocks_needed + 1, block_bytes);
    let kv = KvRegion::create(pair.shm_path(name), layout).unwrap();
    let worker = name.to_string();
    let region = client
        .register_with_geometry(
            &worker,
            kv.memory.path(),
            layout,
            Some(geometry.clone()),
            true,
        )
        .await
        .unwrap();
    // The request's blocks scattered, in reverse, with gaps.
    let ids = (0..blocks_needed)
        .map(|b| 2 * (blocks_needed - b))
        .collect();
    let rank = Rank {
        worker,
        geometry,
        kv,
        region,
        ids,
    };
    if fill {
        for layer in 0..LAYERS {
            for plane in 0..PLANES {
                for token in 0..TOKENS {
                    for head in rank.heads() {
                        let at = rank.offset(layer, plane, token, head);
                        rank.kv
                            .memory
                            .write_at(at, &kv_bytes(layer, plane, token, head))
                            .unwrap();
                    }
                }
            }
        }
    }
    rank
}

/// Whether `rank`'s blocks hold exactly the reference reshaping.
fn check(rank: &Rank, what: &str) {
    let mut got = vec![0u8; rank.kv.memory.len() as usize];
    rank.kv.memory.read_at(0, &mut got).unwrap();
    let mut expected = vec![0u8; got.len()];
    for layer in 0..LAYERS {
        for plane in 0..PLANES {
            for token in 0..TOKENS {
                for head in rank.heads() {
                    let at = rank.offset(layer, plane, token, head) as usize;
                    expected[at..at + HEAD_BYTES as usize]
                        .copy_from_slice(&kv_bytes(layer, plane, token, head));
                }
            }
        }
    }
    assert!(
        got == expected,
        "{what}: the decode rank's blocks differ from the reference"
    );
}

fn core_geometry(g: &KvGeometry) -> kvrail_core::KvGeometry {
    kvrail_core::KvGeometry::try_from(g).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_tp_pair_lands_the_reference_reshaping() {
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let tps = [1u32, 2, 4, 8];
    let mut n = 0u32;
    for &p_tp in &tps {
        for &d_tp in &tps {
            n += 1;
            // Alternate which side has the large blocks, which is HND, and
            // whether decode pulls or prefill pushes.
            let (p_tpb, d_tpb) = if n.is_multiple_of(2) {
                (16, 64)
            } else {
                (64, 16)
            };
            let p_hnd = n % 4 < 2;
            let pull = (n / 2).is_multiple_of(2);
            let mut prefill = Vec::new();
            for r in 0..p_tp {
                let name = format!("p{n}-{r}");
                prefill.push(rank(&mut p, &pair, &name, p_tp, r, p_tpb, p_hnd, true).await);
            }
            let held: Vec<Range<u32>> = prefill.iter().map(Rank::heads).collect();
            for r in 0..d_tp {
                let name = format!("d{n}-{r}");
                let dest = rank(&mut d, &pair, &name, d_tp, r, d_tpb, !p_hnd, false).await;
                let mut ids = Vec::new();
                for (src, heads) in head_sources(dest.heads(), &held) {
                    let source = &prefill[src];
                    let slice = HeadSlice {
                        head_start: heads.start,
                        head_count: heads.end - heads.start,
                        tokens: TOKENS,
                        chunk_tokens: chunk_tokens(
                            &core_geometry(&source.geometry),
                            &core_geometry(&dest.geometry),
                        ),
                    };
                    let request = format!("req{n}-{r}-{src}");
                    let accepted = if pull {
                        d.pull(
                            &dest.worker,
                            &request,
                            "prefill",
                            source.range(Some(slice)),
                            dest.range(None),
                        )
                        .await
                    } else {
                        p.push(
                            &source.worker,
                            &request,
                            "decode",
                            source.range(Some(slice)),
                            dest.range(None),
                        )
                        .await
                    }
                    .unwrap();
                    ids.push((pull, accepted.transfer_id));
                }
                for (pulled, id) in ids {
                    let c = if pulled { &mut d } else { &mut p };
                    let s = c.wait(id, Some(Duration::from_secs(30))).await.unwrap();
                    assert_eq!(s.state, TransferState::Done as i32, "{s:?}");
                }
                let what = format!(
                    "TP {p_tp} ({p_tpb} tokens/block, {}) -> TP {d_tp} rank {r} ({d_tpb}, {}) by {}",
                    if p_hnd { "HND" } else { "NHD" },
                    if p_hnd { "NHD" } else { "HND" },
                    if pull { "pull" } else { "push" }
                );
                check(&dest, &what);
                dest.kv.unlink();
            }
            for rank in prefill {
                rank.kv.unlink();
            }
        }
    }
}

/// Whole-block transfers between ranks whose blocks hold different things
/// are refused before any byte moves, naming both values: vllm#42895's
/// prefill blocks of 16 tokens against decode blocks of 32 with the same
/// bytes per block, another dtype, another model. The destination stays
/// untouched.
#[tokio::test(flavor = "multi_thread")]
async fn mismatched_geometries_are_refused_naming_both_sides() {
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    // Prefill TP 2 with 16-token blocks, decode TP 4 with 32-token blocks:
    // 4 heads x 16 tokens and 2 heads x 32 tokens are the same bytes.
    let source = rank(&mut p, &pair, "p-mis", 2, 0, 16, true, true).await;
    let dest = rank(&mut d, &pair, "d-mis", 4, 0, 32, true, false).await;
    assert_eq!(source.kv.layout.block_bytes, dest.kv.layout.block_bytes);
    let whole = |r: &Rank, n: usize| BlockRange {
        slice: None,
        ..blocks(r.region, 0..LAYERS, r.ids[..n].to_vec())
    };
    let t = p
        .push(
            &source.worker,
            "mis-1",
            "decode",
            whole(&source, 4),
            whole(&dest, 4),
        )
        .await
        .unwrap();
    let s = p
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(s.state, TransferState::Failed as i32, "{s:?}");
    let why = s.failure.map(|f| f.message).unwrap_or_default();
    assert!(
        why.contains("tokens per block is 32 here and 16 on the peer"),
        "{why}"
    );
    // A pull of another dtype's blocks: refused by the prefill's sidecar.
    let mut other = rank(&mut d, &pair, "d-dtype", 2, 0, 16, true, false).await;
    other.geometry.dtype = "float16".into();
    let other_region = d
        .register_with_geometry(
            "d-dtype2",
            other.kv.memory.path(),
            other.kv.layout,
            Some(other.geometry.clone()),
            false,
        )
        .await
        .unwrap();
    other.region = other_region;
    let t = d
        .pull(
            &other.worker,
            "mis-2",
            "prefill",
            whole(&source, 4),
            whole(&other, 4),
        )
        .await
        .unwrap();
    let s = d
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(s.state, TransferState::Failed as i32, "{s:?}");
    let why = s.failure.map(|f| f.message).unwrap_or_default();
    assert!(
        why.contains("bfloat16 here and float16 on the peer"),
        "{why}"
    );
    // Nothing landed in either destination.
    for r in [&dest, &other] {
        let mut got = vec![0u8; r.kv.memory.len() as usize];
        r.kv.memory.read_at(0, &mut got).unwrap();
        assert!(
            got.iter().all(|b| *b == 0),
            "bytes landed in a refused destination"
        );
    }
    // A slice of heads the source does not hold: refused by its own sidecar.
    let slice = HeadSlice {
        head_start: 6,
        head_count: 1,
        tokens: TOKENS,
        chunk_tokens: 32,
    };
    let e = p
        .push(
            &source.worker,
            "mis-3",
            "decode",
            source.range(Some(slice)),
            dest.range(None),
        )
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("heads 6..7 are not among the 0..4"),
        "{e}"
    );
    for r in [source, dest, other] {
        r.kv.unlink();
    }
}

/// Reads notifications of `stream` until one for `request_id`; returns all
/// read, that one last.
/// A transfer group of `members` named `id`.
fn group(id: &str, members: u32) -> kvrail_client::proto::TransferGroup {
    kvrail_client::proto::TransferGroup {
        id: id.into(),
        members,
    }
}

async fn notes_until(
    stream: &mut tonic::Streaming<kvrail_client::proto::Notification>,
    request_id: &str,
) -> Vec<kvrail_client::proto::Notification> {
    use tokio_stream::StreamExt;
    let mut out = Vec::new();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .expect("a notification within 30 s")
            .expect("the stream is open")
            .unwrap();
        let last = n.request_id == request_id;
        out.push(n);
        if last {
            return out;
        }
    }
}

/// A decode rank reading its heads from four prefill ranks is one logical
/// transfer: its worker gets one PULL_DONE for the group (bytes summed), no
/// notification per member; a group whose member fails gets one FAILED,
/// and nothing more of it; a member that disagrees on the group is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_decode_rank_reading_several_prefill_ranks_completes_once() {
    use kvrail_client::proto::NotificationKind;
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let mut prefill = Vec::new();
    for r in 0..4 {
        prefill.push(rank(&mut p, &pair, &format!("gp-{r}"), 4, r, 16, true, true).await);
    }
    let dest = rank(&mut d, &pair, "gd", 1, 0, 16, true, false).await;
    let mut notes = d.subscribe(&dest.worker).await.unwrap();
    let mut total = 0;
    for (i, source) in prefill.iter().enumerate() {
        let slice = HeadSlice {
            head_start: source.geometry.head_start,
            head_count: source.geometry.heads,
            tokens: TOKENS,
            chunk_tokens: 16,
        };
        let a = d
            .start_in_group(
                false,
                &dest.worker,
                &format!("g-{i}"),
                "prefill",
                source.range(Some(slice)),
                dest.range(None),
                group("req-g", 4),
            )
            .await
            .unwrap();
        total += a.total_bytes;
    }
    let got = notes_until(&mut notes, "req-g").await;
    assert_eq!(got.len(), 1, "one notification for the group: {got:?}");
    assert_eq!(got[0].kind, NotificationKind::PullDone as i32, "{got:?}");
    assert_eq!(got[0].bytes, total);
    check(&dest, "TP 4 -> TP 1 as one group");

    // A member that disagrees on the group's size is refused by name.
    let source = &prefill[0];
    let slice = HeadSlice {
        head_start: 0,
        head_count: 2,
        tokens: TOKENS,
        chunk_tokens: 16,
    };
    d.start_in_group(
        false,
        &dest.worker,
        "f-0",
        "prefill",
        source.range(Some(slice)),
        dest.range(None),
        group("req-f", 2),
    )
    .await
    .unwrap();
    let e = d
        .start_in_group(
            false,
            &dest.worker,
            "f-x",
            "prefill",
            source.range(Some(slice)),
            dest.range(None),
            group("req-f", 3),
        )
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("req-f")
            && e.to_string()
                .contains("has 2 members; this transfer says 3"),
        "{e}"
    );
    // Its second member reads a region the prefill does not have: the peer
    // fails it, and the group fails once.
    let bad = BlockRange {
        region_id: source.region + 1000,
        ..source.range(Some(slice))
    };
    d.start_in_group(
        false,
        &dest.worker,
        "f-1",
        "prefill",
        bad,
        dest.range(None),
        group("req-f", 2),
    )
    .await
    .unwrap();
    let got = notes_until(&mut notes, "req-f").await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].kind, NotificationKind::Failed as i32, "{got:?}");

    // A member refused at its start while another still runs (its peer is
    // stopped): the running one is cancelled, and the group reports only once
    // it ended, so that the worker never frees blocks a member may still write.
    pair.prefill.signal("STOP");
    let running = d
        .start_in_group(
            false,
            &dest.worker,
            "c-0",
            "prefill",
            source.range(Some(slice)),
            dest.range(None),
            group("req-c", 2),
        )
        .await
        .unwrap();
    let stale = BlockRange {
        generations: vec![999; dest.ids.len()],
        ..dest.range(None)
    };
    let e = d
        .start_in_group(
            false,
            &dest.worker,
            "c-1",
            "prefill",
            source.range(Some(slice)),
            stale,
            group("req-c", 2),
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("blocks_released"), "{e}");
    let got = notes_until(&mut notes, "req-c").await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].kind, NotificationKind::Failed as i32, "{got:?}");
    assert!(
        got[0]
            .failure
            .as_ref()
            .is_some_and(|f| f.code == "blocks_released"),
        "the first failure is reported: {got:?}"
    );
    let s = d.get_transfer(running.transfer_id).await.unwrap();
    assert_eq!(
        s.state,
        TransferState::Failed as i32,
        "the running member ended before the group reported: {s:?}"
    );
    pair.prefill.signal("CONT");
    // Nothing more of the failed group: the next notification is a marker's.
    let marker = d
        .pull(
            &dest.worker,
            "marker",
            "prefill",
            source.range(Some(slice)),
            dest.range(None),
        )
        .await
        .unwrap();
    let got = notes_until(&mut notes, "marker").await;
    assert_eq!(got.len(), 1, "only the marker's: {got:?}");
    assert_eq!(got[0].transfer_id, marker.transfer_id);
    for r in prefill.into_iter().chain([dest]) {
        r.kv.unlink();
    }
}

/// Four prefill ranks (four workers) pushing their heads into one TP 1
/// decode rank name the decode's receiver group: its worker gets one
/// PUSH_RECEIVED for the group (bytes summed) and none per push, with every
/// head in place; a push naming another member count fails the group once,
/// and nothing more of it is reported; a malformed group is refused at the
/// sender's API.
#[tokio::test(flavor = "multi_thread")]
async fn several_prefill_ranks_pushing_one_decode_rank_complete_once() {
    use kvrail_client::proto::NotificationKind;
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let mut prefill = Vec::new();
    for r in 0..4 {
        prefill.push(rank(&mut p, &pair, &format!("rp-{r}"), 4, r, 16, true, true).await);
    }
    let dest = rank(&mut d, &pair, "rd", 1, 0, 16, false, false).await;
    let mut notes = d.subscribe(&dest.worker).await.unwrap();
    let slice_of = |source: &Rank| HeadSlice {
        head_start: source.geometry.head_start,
        head_count: source.geometry.heads,
        tokens: TOKENS,
        chunk_tokens: 16,
    };
    let mut total = 0;
    for (i, source) in prefill.iter().enumerate() {
        let a = p
            .push_to_receiver_group(
                &source.worker,
                &format!("r-{i}"),
                "decode",
                source.range(Some(slice_of(source))),
                dest.range(None),
                group("req-r", 4),
            )
            .await
            .unwrap();
        total += a.total_bytes;
    }
    let got = notes_until(&mut notes, "req-r").await;
    assert_eq!(got.len(), 1, "one notification for the group: {got:?}");
    assert_eq!(
        got[0].kind,
        NotificationKind::PushReceived as i32,
        "{got:?}"
    );
    assert_eq!(got[0].bytes, total);
    check(&dest, "TP 4 -> TP 1 pushed as one receiver group");

    // Members that disagree on the group's size: it fails once.
    for (i, members) in [2, 3].into_iter().enumerate() {
        let source = &prefill[i];
        p.push_to_receiver_group(
            &source.worker,
            &format!("m-{i}"),
            "decode",
            source.range(Some(slice_of(source))),
            dest.range(None),
            group("req-m", members),
        )
        .await
        .unwrap();
    }
    let got = notes_until(&mut notes, "req-m").await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].kind, NotificationKind::Failed as i32, "{got:?}");
    let failure = got[0].failure.as_ref().unwrap();
    assert_eq!(failure.code, "group_members_differ", "{failure:?}");
    // The two opens race to the receiver: whichever lands first sets the count.
    let (first, second) = if failure.message.contains("has 2 members") {
        (2, 3)
    } else {
        (3, 2)
    };
    assert!(
        failure.message.contains(&format!("has {first} members"))
            && failure.message.contains(&format!("says {second}")),
        "{failure:?}"
    );
    // Nothing more of the failed group: the next notification is a marker's.
    let source = &prefill[0];
    p.push(
        &source.worker,
        "marker",
        "decode",
        source.range(Some(slice_of(source))),
        dest.range(None),
    )
    .await
    .unwrap();
    let got = notes_until(&mut notes, "marker").await;
    assert_eq!(got.len(), 1, "only the marker's: {got:?}");

    let e = p
        .push_to_receiver_group(
            &source.worker,
            "z",
            "decode",
            source.range(Some(slice_of(source))),
            dest.range(None),
            group("req-z", 0),
        )
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("req-z") && e.to_string().contains("has 0 members"),
        "{e}"
    );
    for r in prefill.into_iter().chain([dest]) {
        r.kv.unlink();
    }
}
