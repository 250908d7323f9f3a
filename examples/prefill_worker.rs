//! A prefill worker: computes (here: fills with a checkable pattern) a request's
//! KV blocks and hands them to a decode node, by pushing them into the decode
//! worker's blocks, or by exposing them for the decode worker to pull.
//! See decode_worker.rs for the two ways to run the pair.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use kvrail_client::proto::NotificationKind;
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_examples::{fill, scattered_blocks, Handoff};
use tokio_stream::StreamExt;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    socket: PathBuf,
    #[arg(long)]
    handoff: PathBuf,
    /// Expose the blocks and wait for the decode worker to pull them.
    #[arg(long)]
    expose: bool,
    /// Peer node that holds the decode worker (push mode).
    #[arg(long, default_value = "decode")]
    peer: String,
    #[arg(long, default_value = "prefill-0")]
    worker: String,
    #[arg(long, default_value_t = 8)]
    layers: u32,
    #[arg(long, default_value_t = 256)]
    num_blocks: u32,
    #[arg(long, default_value_t = 64)]
    blocks: usize,
    #[arg(long, default_value_t = 32768)]
    block_bytes: u64,
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
    let region = client.register_region(&a.worker, &kv, a.expose).await?;
    let mut notes = client.subscribe(&a.worker).await?;
    let my_blocks = scattered_blocks(a.blocks, a.num_blocks, a.seed ^ 0x9e3779b9);
    fill(&kv, a.seed, 0..a.layers, &my_blocks)?;

    if a.expose {
        Handoff {
            node: "prefill".into(),
            region_id: region,
            layers: a.layers,
            block_ids: my_blocks.clone(),
            request_id: "request-0".into(),
        }
        .write(&a.handoff)?;
        println!("READY region={region}");
        let n = tokio::time::timeout(Duration::from_secs(60), notes.next())
            .await
            .context("nobody pulled within 60 s")?
            .context("notification stream ended")??;
        if NotificationKind::try_from(n.kind) != Ok(NotificationKind::PullServed) {
            bail!("unexpected notification: {n:?}");
        }
        println!("SERVED {} bytes; blocks may be freed", n.bytes);
    } else {
        let h = Handoff::read(&a.handoff).context("reading the decode worker's hand-off")?;
        let t = client
            .push(
                &a.worker,
                &h.request_id,
                &a.peer,
                blocks(region, 0..a.layers, my_blocks),
                blocks(h.region_id, 0..h.layers, h.block_ids),
            )
            .await?;
        let status = client
            .wait(t.transfer_id, Some(Duration::from_secs(60)))
            .await?;
        if let Some(f) = status.failure {
            bail!("push failed ({}): {}", f.code, f.message);
        }
        println!(
            "PUSHED {} bytes in {} us ({} segments)",
            t.total_bytes, status.elapsed_us, t.segments
        );
    }
    client.unregister_region(region).await?;
    kv.unlink();
    Ok(())
}
