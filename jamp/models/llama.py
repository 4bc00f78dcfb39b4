"""A Llama-style decoder-only language model: RMSNorm, rotary positions, grouped-query attention,
SwiGLU MLP, untied output head, no biases.

With V = vocab_size, d = d_model, N = num_layers, m = mlp_dim and
h_kv = d / num_heads * num_kv_heads (the width of k and of v), the parameter count is

  2 V d + d + N (2 d^2 + 2 d h_kv + 3 d m + 2 d)

(embedding and head; final norm; per block q and o, k and v, gate / up / down, two norms).
Llama-2-7B's shapes (V 32000, d 4096, N 32, m 11008, h_kv = d) give 6,738,415,616.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


def rotate(x_BLHD, theta: float):
    """Rotary position embedding: rotates each pair (x_i, x_{i + D/2}) of a head's D features by
    the angle position * theta^(-2i/D), positions 0 .. L-1 (the "rotate half" pairing of GPT-NeoX
    and Hugging Face's Llama).
    """
    length, head_dim = x_BLHD.shape[1], x_BLHD.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2) / head_dim)
    angles = jnp.arange(length)[:, None] * inv_freq[None, :]  # [L, D/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # the same for all heads
    x1, x2 = jnp.split(x_BLHD, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nn.Module):
    """Causal self-attention with rotary positions; k / v heads are shared by groups of q heads."""

    num_heads: int
    num_kv_heads: int
    rope_theta: float

    @nn.compact
    def __call__(self, x_BLD):
        d_model = x_BLD.shape[-1]
        head_dim = d_model // self.num_heads

        def dense(heads, name):  # x [B, L, d] -> [B, L, heads, head_dim]
            return nn.DenseGeneral((heads, head_dim), use_bias=False, name=name)

        q_BLHD = rotate(dense(self.num_heads, "q")(x_BLD), self.rope_theta)
        k_BLKD = rotate(dense(self.num_kv_heads, "k")(x_BLD), self.rope_theta)
        v_BLKD = dense(self.num_kv_heads, "v")(x_BLD)
        # Query heads in groups of G per kv head (head h reads kv head h // G), without repeating
        # k and v G times: the repeated copies would be written and kept for the backward.
        b, length, kv_heads = x_BLD.shape[0], x_BLD.shape[1], self.num_kv_heads
        q_BLKGD = q_BLHD.reshape(b, length, kv_heads, -1, head_dim)

        scores_BKGLL = jnp.einsum("bqkgd,bskd->bkgqs", q_BLKGD, k_BLKD) * head_dim**-0.5
        positions = jnp.arange(length)
        causal_LL = positions[:, None] >= positions[None, :]  # query i sees keys 0 .. i
        scores_BKGLL = jnp.where(causal_LL, scores_BKGLL, jnp.finfo(scores_BKGLL.dtype).min)
        weights_BKGLL = jax.nn.softmax(scores_BKGLL, axis=-1)
        out_BLKGD = jnp.einsum("bkgqs,bskd->bqkgd", weights_BKGLL, v_BLKD)
        out_BLHD = out_BLKGD.reshape(b, length, self.num_heads, head_dim)
        return nn.DenseGeneral(d_model, axis=(-2, -1), use_bias=False, name="o")(out_BLHD)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    mlp_dim: int

    @nn.compact
    def __call__(self, x_BLD):
        gate = nn.Dense(self.mlp_dim, use_bias=False, name="gate")(x_BLD)
        up = nn.Dense(self.mlp_dim, use_bias=False, name="up")(x_BLD)
        return nn.Dense(x_BLD.shape[-1], use_bias=False, name="down")(nn.silu(gate) * up)


class LlamaBlock(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    num_heads: int
    num_kv_heads: int
    mlp_dim: int
    rope_theta: float

    @nn.compact
    def __call__(self, x_BLD):
        attn = Attention(self.num_heads, self.num_kv_heads, self.rope_theta, name="attn")
        x_BLD = x_BLD + attn(nn.RMSNorm(name="attn_norm")(x_BLD))
        return x_BLD + SwiGLU(self.mlp_dim, name="mlp")(nn.RMSNorm(name="mlp_norm")(x_BLD))


#: What each block keeps for the backward pass (`LlamaLM.remat`): "none" everything (XLA keeps
#: even the weights FSDP gathered for the forward until the backward: a whole model in 16 bits
#: per device); "dots" the outputs of its matmuls without batch axes (the dense layers), the
#: rest recomputed, FSDP's weights gathered again for the backward; "full" only its input.
REMAT = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


class LlamaLM(nn.Module):
    """Next-token logits [batch, length, vocab] for integer tokens [batch, length].

    num_kv_heads must divide num_heads (num_kv_heads == num_heads: plain multi-head attention),
    num_heads must divide d_model into an even head size, and length must be at most max_len.

    Example::

      model = LlamaLM(vocab_size=256, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                      mlp_dim=64, max_len=128)
      logits_BLV = model.apply(variables, tokens_BL)
      hidden_BLD = model.apply(variables, tokens_BL, return_hidden=True)  # the head's input
      kernel_DV = LlamaLM.output_kernel(variables["params"])             # and its weight
    """

    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    mlp_dim: int
    max_len: int
    rope_theta: float = 10000.0
    remat: str = "none"

    def __post_init__(self):  # checked on construction, so that a bad config fails in one line
        head_dim, odd = divmod(self.d_model, self.num_heads)
        if odd or head_dim % 2 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaLM needs num_heads dividing d_model into an even head size and "
                f"num_kv_heads dividing num_heads; got d_model {self.d_model}, num_heads "
                f"{self.num_heads}, num_kv_heads {self.num_kv_heads}"
            )
        if self.remat not in REMAT:
            raise ValueError(f"LlamaLM: unknown remat {self.remat!r}; accepted: {', '.join(REMAT)}")
        super().__post_init__()

    @nn.compact
    def __call__(self, tokens_BL, train: bool = False, return_hidden: bool = False):
        del train  # no dropout, as in Llama
        if tokens_BL.shape[1] > self.max_len:
            raise ValueError(
                f"LlamaLM: sequence length {tokens_BL.shape[1]} exceeds max_len {self.max_len}"
            )
        x_BLD = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens_BL)
        block_class = LlamaBlock
        if self.remat != "none":
            block_class = nn.remat(LlamaBlock, policy=REMAT[self.remat])
        for i in range(self.num_layers):
            block = block_class(
                self.num_heads, self.num_kv_heads, self.mlp_dim, self.rope_theta, name=f"layers_{i}"
            )
            x_BLD = block(x_BLD)
        x_BLD = nn.RMSNorm(name="final_norm")(x_BLD)
        if return_hidden:  # for a loss that applies the head itself (jamp.losses)
            return x_BLD
        return nn.Dense(self.vocab_size, use_bias=False, name="lm_head")(x_BLD)

    @staticmethod
    def output_kernel(params):
        """The output head's [d_model, vocab] weight in `params`."""
        return params["lm_head"]["kernel"]
