#include "kernels/layer_kernels.cuh"

namespace epflow::kernels {

namespace {
size_t align(size_t v) { return (v + 255) / 256 * 256; }
}  // namespace

WindowLayout WindowLayout::make(int64_t max_tokens, int64_t hidden, int32_t top_k) {
  WindowLayout l;
  size_t at = 0;
  l.flags = at;
  at = align(at + sizeof(uint64_t) * kMaxPeers);
  l.tokens = at;
  at = align(at + sizeof(int64_t));
  l.topk_idx = at;
  at = align(at + sizeof(int32_t) * max_tokens * top_k);
  l.x = at;
  at = align(at + sizeof(__nv_bfloat16) * max_tokens * hidden);
  l.combine = at;
  at = align(at + sizeof(__nv_bfloat16) * max_tokens * top_k * hidden);
  l.topk_weights = at;
  at = align(at + sizeof(float) * max_tokens * top_k);
  l.dy = at;
  at = align(at + sizeof(__nv_bfloat16) * max_tokens * hidden);
  l.d_weights = at;
  at = align(at + sizeof(float) * max_tokens * top_k);
  l.bytes = at;
  return l;
}

}  // namespace epflow::kernels
