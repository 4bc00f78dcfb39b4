"""A small decoder-only Transformer language model (pre-LayerNorm, causal, tied embeddings)."""

import flax.linen as nn


class DecoderBlock(nn.Module):
    """Causal self-attention and an MLP, each behind a LayerNorm with a residual connection."""

    num_heads: int
    mlp_dim: int
    dropout_rate: float

    @nn.compact
    def __call__(self, x, mask, train: bool):
        drop = nn.Dropout(self.dropout_rate, deterministic=not train)
        y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, deterministic=True)(
            nn.LayerNorm()(x), mask=mask
        )
        x = x + drop(y)
        y = nn.Dense(self.mlp_dim)(nn.LayerNorm()(x))
        y = nn.Dense(x.shape[-1])(nn.gelu(y))
        return x + drop(y)


class TransformerLM(nn.Module):
    """Next-token logits for integer token sequences of shape [batch, length].

    Example::

      model = TransformerLM(vocab_size=256, num_layers=2)
      logits_BLV = model.apply(variables, tokens_BL)
      hidden_BLD = model.apply(variables, tokens_BL, return_hidden=True)  # the head's input
      kernel_DV = TransformerLM.output_kernel(variables["params"])       # and its weight
    """

    vocab_size: int
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 4
    mlp_dim: int = 1024
    max_len: int = 1024
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, tokens_BL, train: bool = False, return_hidden: bool = False):
        length = tokens_BL.shape[1]
        embed = nn.Embed(self.vocab_size, self.d_model)
        positions = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model)
        )
        x = embed(tokens_BL) + positions[:length]
        mask = nn.make_causal_mask(tokens_BL)
        for _ in range(self.num_layers):
            x = DecoderBlock(self.num_heads, self.mlp_dim, self.dropout_rate)(x, mask, train)
        x = nn.LayerNorm()(x)
        if return_hidden:  # for a loss that applies the head itself (jamp.losses)
            return x
        # Tied output embedding: a raw matmul against a parameter, which wrapping must still reach.
        return embed.attend(x)

    @staticmethod
    def output_kernel(params):
        """The output head's [d_model, vocab] weight in `params`: the tied embedding, transposed."""
        return params["Embed_0"]["embedding"].T
