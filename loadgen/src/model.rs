//! KV geometry of common models (numbers from `shared/traces/models.json`,
//! which cites each model's config) and a prefill-time model.

/// How a layer's KV is laid out per token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attention {
    /// K and V per KV head (GQA/MHA): vLLM's FlashAttention tensor
    /// `[2, num_blocks, block_size, kv_heads, head_dim]`.
    Gqa { kv_heads: u32, head_dim: u32 },
    /// One latent per token (MLA: kv_lora_rank + qk_rope_head_dim), replicated
    /// on every tensor-parallel rank: `[num_blocks, block_size, latent]`.
    Mla { latent: u32 },
}

/// Where a model's prefill time comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PrefillCurve {
    /// ms = c + a*T + b*T^2, measured on one H100 (bf16, batch 1; models.json).
    Measured { c: f64, a: f64, b: f64 },
    /// Another model's measured fit times a factor (per-token compute ratio of
    /// the two geometries); an estimate, labelled as such.
    Derived { from: &'static str, factor: f64 },
}

/// One model's KV-cache geometry and its prefill-time model.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    pub name: &'static str,
    pub num_layers: u32,
    pub attention: Attention,
    pub dtype_bytes: u32,
    /// Longest prompt the model takes (max_position_embeddings).
    pub context_tokens: u64,
    /// vLLM block size (16 by default; MLA backends use 64).
    pub block_tokens: u64,
    pub prefill: PrefillCurve,
}

/// vLLM's default block size in tokens.
pub const BLOCK_TOKENS: u64 = 16;

const fn gqa(kv_heads: u32) -> Attention {
    Attention::Gqa {
        kv_heads,
        head_dim: 128,
    }
}

const LLAMA_8B_FIT: PrefillCurve = PrefillCurve::Measured {
    c: 1.225,
    a: 0.026298,
    b: 4.51e-7,
};

pub const MODELS: &[Model] = &[
    Model {
        name: "llama-3.1-8b",
        num_layers: 32,
        attention: gqa(8),
        dtype_bytes: 2,
        context_tokens: 131_072,
        block_tokens: BLOCK_TOKENS,
        prefill: LLAMA_8B_FIT,
    },
    Model {
        name: "mistral-7b",
        num_layers: 32,
        attention: gqa(8),
        dtype_bytes: 2,
        context_tokens: 32_768,
        block_tokens: BLOCK_TOKENS,
        // Same layer count and KV geometry, slightly smaller MLP (14336 as well): same fit.
        prefill: PrefillCurve::Derived {
            from: "llama-3.1-8b",
            factor: 1.0,
        },
    },
    Model {
        name: "qwen3-8b",
        num_layers: 36,
        attention: gqa(8),
        dtype_bytes: 2,
        context_tokens: 40_960,
        block_tokens: BLOCK_TOKENS,
        // 36 layers of a similar width: 36/32 of Llama-3.1-8B.
        prefill: PrefillCurve::Derived {
            from: "llama-3.1-8b",
            factor: 1.125,
        },
    },
    Model {
        name: "qwen2.5-32b",
        num_layers: 64,
        attention: gqa(8),
        dtype_bytes: 2,
        context_tokens: 131_072,
        block_tokens: BLOCK_TOKENS,
        prefill: PrefillCurve::Measured {
            c: 5.858,
            a: 0.104054,
            b: 1.352e-6,
        },
    },
    Model {
        name: "qwen3-32b",
        num_layers: 64,
        attention: gqa(8),
        dtype_bytes: 2,
        context_tokens: 40_960,
        block_tokens: BLOCK_TOKENS,
        // Same layers and hidden size as Qwen2.5-32B.
        prefill: PrefillCurve::Derived {
            from: "qwen2.5-32b",
            factor: 1.0,
        },
    },
    Model {
        name: "llama-3.1-70b",
        num_layers: 80,
        attention: gqa(8),
        dtype_bytes: 2,
        context_tokens: 131_072,
        block_tokens: BLOCK_TOKENS,
        prefill: PrefillCurve::Measured {
            c: -24.563,
            a: 0.235612,
            b: 2.189e-6,
        },
    },
    Model {
        name: "llama-3.1-405b",
        num_layers: 126,
        attention: gqa(8),
        dtype_bytes: 2,
        context_tokens: 131_072,
        block_tokens: BLOCK_TOKENS,
        // ~405/70 of the 70B's per-token compute.
        prefill: PrefillCurve::Derived {
            from: "llama-3.1-70b",
            factor: 5.8,
        },
    },
    Model {
        name: "qwen3-235b-a22b",
        num_layers: 94,
        attention: gqa(4),
        dtype_bytes: 2,
        context_tokens: 40_960,
        block_tokens: BLOCK_TOKENS,
        // MoE, 22B active parameters: ~22/32 of a dense 32B.
        prefill: PrefillCurve::Derived {
            from: "qwen2.5-32b",
            factor: 0.7,
        },
    },
    Model {
        name: "deepseek-v3",
        num_layers: 61,
        attention: Attention::Mla { latent: 576 },
        dtype_bytes: 2,
        context_tokens: 163_840,
        block_tokens: 64,
        // MoE, 37B active parameters: ~37/32 of a dense 32B.
        prefill: PrefillCurve::Derived {
            from: "qwen2.5-32b",
            factor: 1.15,
        },
    },
    Model {
        name: "kimi-k2",
        num_layers: 61,
        attention: Attention::Mla { latent: 576 },
        dtype_bytes: 2,
        context_tokens: 131_072,
        block_tokens: 64,
        // DeepSeek-V3 architecture, 32B active parameters.
        prefill: PrefillCurve::Derived {
            from: "qwen2.5-32b",
            factor: 1.0,
        },
    },
];

impl Model {
    pub fn by_name(name: &str) -> Option<&'static Model> {
        MODELS.iter().find(|m| m.name.eq_ignore_ascii_case(name))
    }

    /// Names of the table, for error messages.
    pub fn names() -> String {
        MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
    }

    /// 2 (K and V) for GQA, 1 for an MLA latent.
    pub fn planes(&self) -> u32 {
        match self.attention {
            Attention::Gqa { .. } => 2,
            Attention::Mla { .. } => 1,
        }
    }

    /// Bytes of one token in one layer and plane on one of `tp` tensor-parallel
    /// ranks: GQA splits KV heads (replicated once tp exceeds them), MLA
    /// replicates its latent.
    pub fn token_bytes_per_plane(&self, tp: u32) -> u64 {
        let tp = tp.max(1);
        let per_token = match self.attention {
            Attention::Gqa { kv_heads, head_dim } => {
                u64::from(kv_heads.div_ceil(tp).max(1)) * u64::from(head_dim)
            }
            Attention::Mla { latent } => u64::from(latent),
        };
        per_token * u64::from(self.dtype_bytes)
    }

    /// KV bytes per token over all layers, on one rank of `tp`.
    pub fn kv_bytes_per_token(&self, tp: u32) -> u64 {
        u64::from(self.num_layers) * u64::from(self.planes()) * self.token_bytes_per_plane(tp)
    }

    /// Bytes of one vLLM block in one layer and plane (one contiguous chunk).
    pub fn block_bytes(&self, tp: u32) -> u64 {
        self.block_tokens * self.token_bytes_per_plane(tp)
    }

    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_tokens)
    }

    /// Modelled single-GPU prefill time in milliseconds.
    pub fn prefill_ms(&self, tokens: u64) -> f64 {
        let t = tokens as f64;
        let (fit, factor) = self.measured_fit();
        let (c, a, b) = fit;
        ((c + a * t + b * t * t) * factor).max(0.0)
    }

    /// The measured fit behind this model's curve, and the factor applied.
    fn measured_fit(&self) -> ((f64, f64, f64), f64) {
        match self.prefill {
            PrefillCurve::Measured { c, a, b } => ((c, a, b), 1.0),
            PrefillCurve::Derived { from, factor } => {
                let base = Model::by_name(from)
                    .map(|m| m.measured_fit())
                    .unwrap_or(((1.225, 0.026298, 4.51e-7), 1.0));
                (base.0, base.1 * factor)
            }
        }
    }

    /// Where the prefill curve comes from, for reports.
    pub fn prefill_source(&self) -> String {
        match self.prefill {
            PrefillCurve::Measured { .. } => {
                "measured H100 bf16 fit (shared/traces/models.json)".into()
            }
            PrefillCurve::Derived { from, factor } => {
                format!("estimate: {from}'s measured H100 fit x {factor}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_matches_models_json() {
        // kv_bytes_per_token of every models.json entry.
        for (name, bytes) in [
            ("llama-3.1-8b", 131_072),
            ("mistral-7b", 131_072),
            ("qwen3-8b", 147_456),
            ("qwen2.5-32b", 262_144),
            ("qwen3-32b", 262_144),
            ("llama-3.1-70b", 327_680),
            ("llama-3.1-405b", 516_096),
            ("qwen3-235b-a22b", 192_512),
            ("deepseek-v3", 70_272),
            ("kimi-k2", 70_272),
        ] {
            let m = Model::by_name(name).unwrap();
            assert_eq!(m.kv_bytes_per_token(1), bytes, "{name}");
        }
        let m = Model::by_name("Llama-3.1-8B").unwrap();
        assert_eq!(m.block_bytes(1), 32_768);
        assert_eq!(m.blocks_for(6758), 423);
        // TP=8 of a 70B: one KV head per rank, 4 KiB chunks (models.json's note).
        let big = Model::by_name("llama-3.1-70b").unwrap();
        assert_eq!(big.block_bytes(8), 4096);
        assert_eq!(big.kv_bytes_per_token(8), 327_680 / 8);
        // Past the KV head count heads replicate; MLA always does.
        assert_eq!(big.block_bytes(16), 4096);
        let ds = Model::by_name("deepseek-v3").unwrap();
        assert_eq!(ds.block_bytes(8), 64 * 576 * 2);
        assert_eq!(ds.kv_bytes_per_token(8), 70_272);
    }

    #[test]
    fn prefill_curves() {
        let m = Model::by_name("llama-3.1-8b").unwrap();
        // By hand: 1.225 + 0.026298*8192 + 4.51e-7*8192^2 = 246.92 ms,
        // within 3% of the 241.89 ms models.json measured at 8192 tokens.
        assert!((m.prefill_ms(8192) - 246.924).abs() < 0.01);
        assert!((m.prefill_ms(8192) - 241.89).abs() / 241.89 < 0.03);
        let q = Model::by_name("qwen3-8b").unwrap();
        assert!((q.prefill_ms(8192) - 246.924 * 1.125).abs() < 0.01);
        assert!(q.prefill_source().starts_with("estimate"));
        // Every derived curve names a measured model.
        for m in MODELS {
            if let PrefillCurve::Derived { from, .. } = m.prefill {
                assert!(
                    matches!(
                        Model::by_name(from).map(|f| f.prefill),
                        Some(PrefillCurve::Measured { .. })
                    ),
                    "{}",
                    m.name
                );
            }
        }
    }
}
