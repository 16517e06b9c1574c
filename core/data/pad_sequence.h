#pragma once
// Variable-length sequences as one padded batch, as torch.nn.utils.rnn.pad_sequence:
//   sequences[i] (L_i, *) -> (B, max L, *) (batch_first) or (max L, B, *), positions past L_i filled with
//   padding_value. The sequences share their trailing dims, dtype and device.
// The mask of padded positions (what attention's key_padding_mask takes) comes from the lengths:
//   padding_mask(lengths, max_len) -> bool (B, max_len), true at positions >= lengths[b].
//   std::vector<Tensor> lines = ...;                    // i64 token ids, one tensor per line
//   Tensor tokens = data::pad_sequence(lines);          // (B, T)
//   Tensor pad = data::padding_mask({3, 5}, tokens.size(1));
#include <cstdint>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::data {

Tensor pad_sequence(const std::vector<Tensor>& sequences, bool batch_first = true, double padding_value = 0.0);
Tensor padding_mask(const std::vector<int64_t>& lengths, int64_t max_len, Device device = Device::cpu());

}  // namespace kiln::data
