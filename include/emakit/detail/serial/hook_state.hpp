// The EmaHook checkpoint (formats::hook): what EmaHook::save_checkpoint writes for each model key
// K and how it is read back. EmaHook says what each model holds; this header writes and reads it.
//
//   K                    the model's weights in Module::save's layout (one nested archive per
//                        child module)
//   emakit_hook/format   int64, formats::hook.version
//   emakit_hook/emakit_version   the writer's version, for messages
//   emakit_hook/K/meta   int64[5]: EMA made, state pending, update() calls and completed steps
//                        seen before the EMA was made, K holds the EMA weights
//   emakit_hook/K/state  the EMA's state dict (ema_state.hpp), when made or pending
//   emakit_hook/K/online the model's own weights by name, when K holds the EMA's
//   emakit_hook/K/checksums   a CRC-32 per tensor: "meta", "state/<key>", "online/<name>",
//                        "weights/<name>"
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/checksum.hpp>
#include <emakit/detail/serial/ema_state.hpp>
#include <emakit/detail/serial/formats.hpp>
#include <emakit/detail/serial/match.hpp>
#include <emakit/detail/serial/tensor_dict.hpp>
#include <emakit/state.hpp>
#include <emakit/version.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <fmt/core.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

using TensorMap = std::unordered_map<std::string, at::Tensor>;

// Writes `model`'s tensors in Module::save's layout (one nested archive per child module), each
// tensor taken from `replace` where it has one, converted to the model tensor's dtype and
// device. Every tensor is copied: the archive does not change when training goes on.
EMAKIT_FUNC void write_module(const torch::nn::Module& model, torch::serialize::OutputArchive& archive,
                              const std::string& prefix, const TensorMap& replace, Checksums* sums = nullptr);

// Reads the tensors of `model`'s names from an archive in Module::save's layout into `out`
// (by full name); names the archive lacks are left out. Nothing is written into the model.
EMAKIT_FUNC void read_module(const torch::nn::Module& model, torch::serialize::InputArchive& archive,
                             const std::string& prefix, TensorMap& out);

// The weights of `model` found in a checkpoint, checked against the model: every tensor there,
// with the model's shape (`exhaustive`: and no other). Returns (model tensor, checkpoint tensor)
// pairs to copy.
EMAKIT_FUNC std::vector<std::pair<at::Tensor, at::Tensor>> plan_weights(const torch::nn::Module& model,
                                                                        const TensorMap& found, bool exhaustive,
                                                                        LoadMode mode, const std::string& where);

namespace hook_state {

// emakit_hook/K/meta.
struct Meta {
  bool created = false;    // the EMA was made
  bool pending = false;    // a loaded state waits for the EMA to be made
  std::int64_t calls = 0;  // update() calls and completed steps seen before the EMA was made
  std::int64_t step = 0;
  bool has_online = false;  // K holds the EMA weights, emakit_hook/K/online the model's own
};

// The header of emakit_hook.
EMAKIT_FUNC void write_header(torch::serialize::OutputArchive& hook);

// Reads emakit_hook from `archive` into `hook` and checks its format.
EMAKIT_FUNC void read_header(torch::serialize::InputArchive& archive, torch::serialize::InputArchive& hook);

// The model keys of emakit_hook (every entry but the header's).
EMAKIT_FUNC bool is_header_key(const std::string& k);

// Writes one model: its weights under `key` (those of `replace` where it has them) and its
// emakit_hook/<key>. `state`: the EMA's state (made or pending), or null; `online`: the model's
// own weights when the checkpoint's model weights are the EMA's (meta.has_online).
EMAKIT_FUNC void write_entry(torch::serialize::OutputArchive& archive, torch::serialize::OutputArchive& hook,
                             const std::string& key, const torch::nn::Module& model, const Meta& meta,
                             const StateDict* state, const TensorMap& replace);

// One model read back, every tensor checked against its checksum and the weights against the
// model; nothing written yet.
struct Entry {
  Meta meta;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (model tensor, saved weights)
  std::optional<StateDict> state;
};

// Reads emakit_hook/<key> and the weights; nullopt when the checkpoint has nothing for this model
// and `mode` is lenient (warned about).
EMAKIT_FUNC std::optional<Entry> read_entry(torch::serialize::InputArchive& archive,
                                            torch::serialize::InputArchive& hook, const std::string& key,
                                            const torch::nn::Module& model, LoadMode mode, const std::string& where);

// The weights of model `key` of a checkpoint, each checked against its checksum: what
// load_weights() reads. `where` names the file and key in errors.
EMAKIT_FUNC TensorMap read_weights(torch::serialize::InputArchive& archive, const torch::nn::Module& model,
                                   const std::string& key, const std::string& file);

}  // namespace hook_state
}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/serial/hook_state-inl.hpp>
#endif
