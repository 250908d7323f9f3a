//! KV geometry of common models (from shared/traces/models.json) and a prefill-time model.

/// One model's KV-cache geometry and its measured prefill-time fit on one H100.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    pub name: &'static str,
    pub num_layers: u32,
    /// K and V (2) for GQA/MHA; 1 for MLA latent caches.
    pub planes: u32,
    /// Bytes of one token in one layer and plane.
    pub token_bytes_per_plane: u64,
    /// Prefill ms = c + a*T + b*T^2 (single-GPU equivalent, bf16, H100).
    pub prefill_fit: (f64, f64, f64),
}

/// vLLM's default block size in tokens.
pub const BLOCK_TOKENS: u64 = 16;

pub const MODELS: &[Model] = &[
    Model {
        name: "llama-3.1-8b",
        num_layers: 32,
        planes: 2,
        token_bytes_per_plane: 8 * 128 * 2,
        prefill_fit: (1.225, 0.026298, 4.51e-7),
    },
    Model {
        name: "llama-3.1-70b",
        num_layers: 80,
        planes: 2,
        token_bytes_per_plane: 8 * 128 * 2,
        prefill_fit: (-24.563, 0.235612, 2.189e-6),
    },
    Model {
        name: "qwen2.5-32b",
        num_layers: 64,
        planes: 2,
        token_bytes_per_plane: 8 * 128 * 2,
        prefill_fit: (5.858, 0.104054, 1.352e-6),
    },
];

impl Model {
    pub fn by_name(name: &str) -> Option<&'static Model> {
        MODELS.iter().find(|m| m.name.eq_ignore_ascii_case(name))
    }

    pub fn kv_bytes_per_token(&self) -> u64 {
        u64::from(self.num_layers) * u64::from(self.planes) * self.token_bytes_per_plane
    }

    /// Bytes of one vLLM block in one layer and plane.
    pub fn block_bytes(&self) -> u64 {
        BLOCK_TOKENS * self.token_bytes_per_plane
    }

    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(BLOCK_TOKENS)
    }

    /// Modelled prefill time in milliseconds.
    pub fn prefill_ms(&self, tokens: u64) -> f64 {
        let t = tokens as f64;
        let (c, a, b) = self.prefill_fit;
        (c + a * t + b * t * t).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_8b_geometry_matches_models_json() {
        let m = Model::by_name("Llama-3.1-8B").unwrap();
        assert_eq!(m.kv_bytes_per_token(), 131_072);
        assert_eq!(m.block_bytes(), 32_768);
        assert_eq!(m.blocks_for(6758), 423);
        // By hand: 1.225 + 0.026298*8192 + 4.51e-7*8192^2 = 246.92 ms,
        // within 3% of the 241.89 ms models.json measured at 8192 tokens.
        assert!(
            (m.prefill_ms(8192) - 246.924).abs() < 0.01,
            "{}",
            m.prefill_ms(8192)
        );
        assert!((m.prefill_ms(8192) - 241.89).abs() / 241.89 < 0.03);
    }
}
