// The non-template definitions of hook_state.hpp: included at the end of hook_state.hpp in the
// all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/hook_state-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/serial/hook_state.hpp> instead"
#endif

#include <emakit/detail/serial/hook_state.hpp>

#include <fmt/format.h>  // fmt::join
#include <fmt/ranges.h>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC void write_module(const torch::nn::Module& model, torch::serialize::OutputArchive& archive,
                              const std::string& prefix, const TensorMap& replace, Checksums* sums) {
  auto pick = [&](const std::string& name, const at::Tensor& own) {
    auto it = replace.find(prefix + name);
    at::Tensor out = it == replace.end() ? own.detach().clone()
                                         : it->second.detach().to(own.options(), /*non_blocking=*/false, /*copy=*/true);
    if (sums != nullptr) sums->add("weights/" + prefix + name, out);
    return out;
  };
  for (const auto& p : model.named_parameters(/*recurse=*/false)) archive.write(p.key(), pick(p.key(), p.value()));
  for (const auto& b : model.named_buffers(/*recurse=*/false))
    archive.write(b.key(), pick(b.key(), b.value()), /*is_buffer=*/true);
  for (const auto& child : model.named_children()) {
    if (!child.value()->is_serializable()) continue;
    torch::serialize::OutputArchive nested(archive.compilation_unit());
    write_module(*child.value(), nested, prefix + child.key() + ".", replace, sums);
    archive.write(child.key(), nested);
  }
}

EMAKIT_FUNC void read_module(const torch::nn::Module& model, torch::serialize::InputArchive& archive,
                             const std::string& prefix, TensorMap& out) {
  for (const auto& p : model.named_parameters(/*recurse=*/false)) {
    at::Tensor t;
    if (archive.try_read(p.key(), t)) out.emplace(prefix + p.key(), t);
  }
  for (const auto& b : model.named_buffers(/*recurse=*/false)) {
    at::Tensor t;
    if (archive.try_read(b.key(), t, /*is_buffer=*/true)) out.emplace(prefix + b.key(), t);
  }
  for (const auto& child : model.named_children()) {
    if (!child.value()->is_serializable()) continue;
    torch::serialize::InputArchive nested;
    if (archive.try_read(child.key(), nested)) read_module(*child.value(), nested, prefix + child.key() + ".", out);
  }
}

EMAKIT_FUNC std::vector<std::pair<at::Tensor, at::Tensor>> plan_weights(const torch::nn::Module& model,
                                                                        const TensorMap& found, bool exhaustive,
                                                                        LoadMode mode, const std::string& where) {
  std::vector<std::pair<std::string, at::Tensor>> ours;
  for (auto& t : collect(model)) ours.emplace_back(std::move(t.name), std::move(t.tensor));
  const NameMatch match = match_by_name(ours, found, exhaustive);
  std::vector<std::string> problems;
  for (const auto& p : match.problems) {
    switch (p.kind) {
      case NameMatch::Problem::Kind::missing:
        problems.push_back(fmt::format("the checkpoint has no tensor '{}'", p.name));
        break;
      case NameMatch::Problem::Kind::shape:
        problems.push_back(fmt::format("tensor '{}' has shape {} in the checkpoint, {} in the model", p.name,
                                       p.theirs_shape, p.ours_shape));
        break;
      case NameMatch::Problem::Kind::unexpected:
        problems.push_back(fmt::format("the checkpoint has a tensor '{}' that the model lacks", p.name));
        break;
    }
  }
  if (!problems.empty()) {
    if (mode == LoadMode::strict)
      fail("{}: the checkpoint is not of this model: {}{}; nothing was loaded", where, problems.front(),
           problems.size() > 1 ? fmt::format(" (and {} more: {})", problems.size() - 1,
                                             fmt::join(problems.begin() + 1, problems.end(), "; "))
                               : std::string());
    for (const auto& p : problems) TORCH_WARN("emakit: ", where, ": ", p, "; kept the model's value");
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  for (const auto& p : match.pairs) copies.emplace_back(p.ours, p.theirs);
  return copies;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::hook_state {

EMAKIT_FUNC void write_header(torch::serialize::OutputArchive& hook) {
  hook.write("format", at::scalar_tensor(formats::hook.version, at::kLong));
  hook.write("emakit_version", c10::IValue(std::string(version_string)));  // the writer's, for messages
}

EMAKIT_FUNC void read_header(torch::serialize::InputArchive& archive, torch::serialize::InputArchive& hook) {
  if (!archive.try_read("emakit_hook", hook))
    fail("load_checkpoint: the archive holds no 'emakit_hook' state; was it written by "
         "EmaHook::save_checkpoint()?");
  c10::IValue format;
  if (!hook.try_read("format", format) || !format.isTensor() || format.toTensor().numel() != 1)
    fail("load_checkpoint: the hook state has no format number; the checkpoint is damaged");
  const std::int64_t found = integer_value(format.toTensor(), "format", "load_checkpoint");
  if (formats::hook.reads(found)) return;
  c10::IValue writer;  // for the message; absent in checkpoints written before emakit recorded its version
  formats::check_version(formats::hook, found, "load_checkpoint",
                         hook.try_read("emakit_version", writer) && writer.isString() ? writer.toStringRef() : "");
}

EMAKIT_FUNC bool is_header_key(const std::string& k) { return k == "format" || k == "emakit_version"; }

EMAKIT_FUNC void write_entry(torch::serialize::OutputArchive& archive, torch::serialize::OutputArchive& hook,
                             const std::string& key, const torch::nn::Module& model, const Meta& meta,
                             const StateDict* state, const TensorMap& replace) {
  torch::serialize::OutputArchive mine(hook.compilation_unit());
  Checksums sums;
  const at::Tensor meta_tensor = at::tensor(std::vector<std::int64_t>{meta.created ? 1 : 0, meta.pending ? 1 : 0,
                                                                      meta.calls, meta.step, meta.has_online ? 1 : 0});
  mine.write("meta", meta_tensor);
  sums.add("meta", meta_tensor);
  if (state != nullptr) {
    std::vector<std::pair<std::string, at::Tensor>> items;
    for (const auto& item : *state) {
      items.emplace_back(item.key(), item.value());
      sums.add("state/" + item.key(), item.value());
    }
    mine.write("state", tensor_dict(items));
  }
  if (meta.has_online) {
    std::vector<std::pair<std::string, at::Tensor>> online;
    for (auto& t : collect(model)) {
      online.emplace_back(t.name, t.tensor);
      sums.add("online/" + t.name, t.tensor);
    }
    mine.write("online", tensor_dict(online));
  }
  torch::serialize::OutputArchive weights(archive.compilation_unit());
  write_module(model, weights, "", replace, &sums);
  archive.write(key, weights);
  mine.write("checksums", tensor_dict(sums.saved, /*copy=*/false));
  hook.write(key, mine);
}

EMAKIT_FUNC std::optional<Entry> read_entry(torch::serialize::InputArchive& archive,
                                            torch::serialize::InputArchive& hook, const std::string& key,
                                            const torch::nn::Module& model, LoadMode mode, const std::string& where) {
  torch::serialize::InputArchive mine;
  if (!hook.try_read(key, mine)) {
    if (mode == LoadMode::lenient) {
      TORCH_WARN("emakit: ", where, ": the checkpoint has nothing for this model; it keeps its weights and EMA");
      return std::nullopt;
    }
    fail("{}: the checkpoint has no hook state for this model; it was saved by a hook without the key '{}'", where,
         key);
  }
  Checksums sums;
  sums.load(mine, "checksums", where);
  c10::IValue meta_value;
  if (!mine.try_read("meta", meta_value) || !meta_value.isTensor())
    fail("{}: the hook state has no 'meta' tensor; the checkpoint is damaged", where);
  const at::Tensor meta = meta_value.toTensor();
  sums.check("meta", meta, where);
  if (meta.dim() != 1 || meta.numel() != 5 || meta.scalar_type() != at::kLong)
    fail("{}: 'meta' must be 5 int64 values, got a {} tensor of shape {}", where, c10::toString(meta.scalar_type()),
         shape_string(meta.sizes()));
  Entry out;
  out.meta = {meta[0].item<std::int64_t>() != 0, meta[1].item<std::int64_t>() != 0, meta[2].item<std::int64_t>(),
              meta[3].item<std::int64_t>(), meta[4].item<std::int64_t>() != 0};
  if (out.meta.calls < 0 || out.meta.step < 0)
    fail("{}: counters must be >= 0, got calls {} and step {}", where, out.meta.calls, out.meta.step);

  // The online weights: beside the EMA's in the hook state, or the model weights themselves.
  TensorMap found;
  bool exhaustive = false;
  if (out.meta.has_online) {
    auto online = read_checked_dict(mine, "online", sums, "online/", where);
    if (!online)
      fail("{}: the hook state says it holds the online weights but has none; the checkpoint is damaged", where);
    for (auto& [k, t] : *online) found.emplace(k, t);
    exhaustive = true;
  } else {
    torch::serialize::InputArchive weights;
    if (!archive.try_read(key, weights)) fail("{}: the checkpoint has no weights under '{}'", where, key);
    read_module(model, weights, "", found);
    for (const auto& [k, t] : found) sums.check("weights/" + k, t, where);
  }
  out.copies = plan_weights(model, found, exhaustive, mode, where);

  if (auto items = read_checked_dict(mine, "state", sums, "state/", where)) {
    out.state.emplace();
    for (auto& [k, t] : *items) out.state->insert(k, t);
  }
  if ((out.meta.created || out.meta.pending) && !out.state)
    fail("{}: the hook state has no EMA state; the checkpoint is damaged", where);
  return out;
}

EMAKIT_FUNC TensorMap read_weights(torch::serialize::InputArchive& archive, const torch::nn::Module& model,
                                   const std::string& key, const std::string& file) {
  torch::serialize::InputArchive weights;
  if (!archive.try_read(key, weights)) fail("load_weights: '{}' has no model '{}'", file, key);
  TensorMap found;
  read_module(model, weights, "", found);
  // The hook's checksums of these weights (LibTorch's reader does not check the archive's own).
  const std::string where = fmt::format("load_weights '{}', model '{}'", file, key);
  torch::serialize::InputArchive hook, mine;
  if (!archive.try_read("emakit_hook", hook) || !hook.try_read(key, mine))
    fail("{}: the file has no emakit hook state; was it written by EmaHook::save_checkpoint()?", where);
  Checksums sums;
  sums.load(mine, "checksums", where);
  for (const auto& [name, t] : found) sums.check("weights/" + name, t, where);
  return found;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::hook_state
