//! A decode worker: owns a paged KV cache in shared memory and receives a
//! request's blocks from a prefill node, by push (it waits to be written) or by
//! pull (it reads the prefill worker's exposed blocks). It verifies every byte.
//!
//! Push:  decode_worker --socket B.sock --handoff h.json            (start first)
//!        prefill_worker --socket A.sock --peer decode --handoff h.json
//! Pull:  prefill_worker --socket A.sock --handoff h.json --expose    (start first)
//!        decode_worker --socket B.sock --peer prefill --handoff h.json --pull

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use kvrail_client::proto::NotificationKind;
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_examples::{scattered_blocks, verify, Handoff};
use tokio_stream::StreamExt;

#[derive(Parser)]
struct Args {
    /// The local sidecar's socket.
    #[arg(long)]
    socket: PathBuf,
    /// Hand-off file shared with the prefill worker.
    #[arg(long)]
    handoff: PathBuf,
    /// Pull from the prefill worker instead of waiting for its push.
    #[arg(long)]
    pull: bool,
    /// Peer node that holds the prefill worker (pull mode).
    #[arg(long, default_value = "prefill")]
    peer: String,
    #[arg(long, default_value = "decode-0")]
    worker: String,
    #[arg(long, default_value_t = 8)]
    layers: u32,
    #[arg(long, default_value_t = 256)]
    num_blocks: u32,
    /// Blocks of the request.
    #[arg(long, default_value_t = 64)]
    blocks: usize,
    /// Bytes of one (layer, K or V, block): vLLM block of 16 tokens x 8 heads x 128 dims x 2 bytes.
    #[arg(long, default_value_t = 32768)]
    block_bytes: u64,
    /// Pattern seed shared with the prefill worker.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long, default_value = "/dev/shm")]
    shm_dir: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let mut client = Client::connect(&a.socket).await?;
    let layout = dense_layout(a.layers, 2, a.num_blocks, a.block_bytes);
    let path = a.shm_dir.join(format!(
        "kvrail-example-{}-{}",
        a.worker,
        std::process::id()
    ));
    let kv = KvRegion::create(&path, layout)?;
    let region = client.register_region(&a.worker, &kv, false).await?;
    let mut notes = client.subscribe(&a.worker).await?;
    let my_blocks = scattered_blocks(a.blocks, a.num_blocks, a.seed ^ 0xdec0de);

    let received = if a.pull {
        let h = Handoff::read(&a.handoff).context("reading the prefill worker's hand-off")?;
        if h.block_ids.len() != my_blocks.len() {
            bail!(
                "hand-off names {} blocks, this worker expects {}",
                h.block_ids.len(),
                my_blocks.len()
            );
        }
        let t = client
            .pull(
                &a.worker,
                &h.request_id,
                &a.peer,
                blocks(h.region_id, 0..h.layers, h.block_ids),
                blocks(region, 0..a.layers, my_blocks.clone()),
            )
            .await?;
        let status = client
            .wait(t.transfer_id, Some(Duration::from_secs(60)))
            .await?;
        if let Some(f) = status.failure {
            bail!("pull failed ({}): {}", f.code, f.message);
        }
        t.total_bytes
    } else {
        let h = Handoff {
            node: "decode".into(),
            region_id: region,
            layers: a.layers,
            block_ids: my_blocks.clone(),
            request_id: "request-0".into(),
        };
        h.write(&a.handoff)?;
        println!("READY region={region}");
        let n = tokio::time::timeout(Duration::from_secs(60), notes.next())
            .await
            .context("no push arrived within 60 s")?
            .context("notification stream ended")??;
        match NotificationKind::try_from(n.kind) {
            Ok(NotificationKind::PushReceived) => n.bytes,
            _ => bail!("unexpected notification: {n:?}"),
        }
    };
    let checked = verify(&kv, a.seed, 0..a.layers, &my_blocks)?;
    if checked != received {
        bail!("verified {checked} bytes but the transfer carried {received}");
    }
    println!("VERIFIED {checked} bytes in {} blocks", my_blocks.len());
    client.unregister_region(region).await?;
    kv.unlink();
    Ok(())
}
