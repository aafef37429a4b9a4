"""The T5 (MoE) encoder-decoder: Flax modules, the T5X-like model wrapper, decoding.

Modules (one job each):
  normalization       RMS layer norm (T5's LayerNorm without bias or centring)
  embedding           token embedding, optionally reused for the logits
  relative_position   T5 relative position buckets -> per-head attention bias
  attention           multi-head dot-product attention, masks, KV cache for decoding
  flash_attention     the fused (flash) attention Pallas kernel (Triton on NVIDIA GPUs)
  mlp                 gated-GELU / ReLU feed-forward block
  t5                  T5Config, encoder/decoder layers and stacks, MoE placement, scanned runs
  layer_stacking      scanned layers' trees to per-layer ones and back (behind the model and
                      the checkpoint boundary)
  losses              cross-entropy with z-loss and label smoothing, token accuracy
  decoding            greedy and temperature sampling over a KV cache
  accounting          parameter counts and analytic FLOPs
  model               EncoderDecoderModel: init, loss_fn, eval_fn, predict_batch, per_layer
"""
