//! A worker whose paged KV cache lives on the GPU (vLLM layout, `cudaMalloc`
//! memory exported by CUDA IPC). `transfer` plays both workers: the prefill side
//! writes its blocks with a GPU kernel and hands them to its sidecar, the decode
//! side receives them through its own sidecar and verifies them with a GPU kernel.
//! `export` only allocates and prints an IPC handle (tests use it to present the
//! handle of a process that has exited).
//!
//!     gpu_worker transfer --prefill-socket /tmp/a.sock --decode-socket /tmp/b.sock --bytes 1G

use std::io::Read;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use kvrail_client::gpu::{cuda, Gpu, GpuKvRegion};
use kvrail_client::proto::TransferState;
use kvrail_client::{blocks, dense_layout, Client};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Move a GPU KV cache from the prefill sidecar's node to the decode one's.
    Transfer {
        #[arg(long)]
        prefill_socket: String,
        #[arg(long)]
        decode_socket: String,
        /// KV bytes (Llama-3.1-8B geometry: 32 layers, K/V, 32 KiB blocks).
        #[arg(long, default_value_t = 1 << 30)]
        bytes: u64,
        /// push (prefill sends) or pull (decode reads).
        #[arg(long, default_value = "push")]
        mode: String,
        #[arg(long, default_value_t = 0)]
        device: u32,
    },
    /// Allocate `bytes` on the GPU, print the IPC handle in hex, exit when stdin closes.
    Export {
        #[arg(long, default_value_t = 1 << 20)]
        bytes: u64,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Args::parse().command {
        Cmd::Transfer {
            prefill_socket,
            decode_socket,
            bytes,
            mode,
            device,
        } => transfer(&prefill_socket, &decode_socket, bytes, &mode, device).await,
        Cmd::Export { bytes } => {
            let gpu = Gpu::open(0)?;
            let buffer = cuda::DeviceBuffer::zeroed(&gpu, bytes)?;
            let hex: String = buffer
                .ipc_handle()?
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            println!("{hex}");
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            Ok(())
        }
    }
}

async fn transfer(
    prefill_socket: &str,
    decode_socket: &str,
    bytes: u64,
    mode: &str,
    device: u32,
) -> anyhow::Result<()> {
    const LAYERS: u32 = 32;
    const BLOCK: u64 = 16 * 8 * 128 * 2;
    let num_blocks = u32::try_from(bytes / (u64::from(LAYERS) * 2 * BLOCK))?.max(1);
    let layout = dense_layout(LAYERS, 2, num_blocks, BLOCK);
    let gpu = Gpu::open(device).context("this example needs a CUDA GPU")?;

    let mut prefill = Client::connect(prefill_socket).await?;
    let mut decode = Client::connect(decode_socket).await?;
    let src = GpuKvRegion::create(&gpu, layout)?;
    let dst = GpuKvRegion::create(&gpu, layout)?;
    let seed = 0x5eed_0001;
    src.fill(seed)?;
    let src_id = src.register(&mut prefill, "gpu-prefill", true).await?;
    let dst_id = dst.register(&mut decode, "gpu-decode", false).await?;

    // Decode's block table differs from prefill's: block b lands in block n-1-b.
    let from: Vec<u32> = (0..num_blocks).collect();
    let to: Vec<u32> = (0..num_blocks).rev().collect();
    let start = Instant::now();
    let (client, t) = match mode {
        "push" => {
            let t = prefill
                .push(
                    "gpu-prefill",
                    "gpu-req-1",
                    "decode",
                    blocks(src_id, 0..LAYERS, from.clone()),
                    blocks(dst_id, 0..LAYERS, to.clone()),
                )
                .await?;
            (&mut prefill, t)
        }
        "pull" => {
            let t = decode
                .pull(
                    "gpu-decode",
                    "gpu-req-1",
                    "prefill",
                    blocks(src_id, 0..LAYERS, from.clone()),
                    blocks(dst_id, 0..LAYERS, to.clone()),
                )
                .await?;
            (&mut decode, t)
        }
        other => bail!("unknown mode {other}: push or pull"),
    };
    let status = client
        .wait(t.transfer_id, Some(Duration::from_secs(300)))
        .await?;
    let elapsed = start.elapsed();
    if status.state != TransferState::Done as i32 {
        bail!("transfer failed: {:?}", status.failure);
    }
    let pairs: Vec<(u32, u32)> = from.into_iter().zip(to).collect();
    let bad = dst.mismatches(&layout, seed, &pairs)?;
    let moved = src.bytes();
    println!(
        "{{\"mode\":\"{mode}\",\"bytes\":{moved},\"seconds\":{:.4},\"gbytes_per_s\":{:.3},\"mismatched_words\":{bad}}}",
        elapsed.as_secs_f64(),
        moved as f64 / elapsed.as_secs_f64() / 1e9
    );
    prefill.unregister_region(src_id).await?;
    decode.unregister_region(dst_id).await?;
    if bad > 0 {
        bail!("{bad} words differ on the GPU");
    }
    Ok(())
}
