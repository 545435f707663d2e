// A dict name -> tensor in torch.save's zip format, written atomically, that Python's
// torch.load(path) reads with its default weights_only=True and LibTorch's torch::pickle_load
// reads too.
//
// torch::pickle_save would do, but it tags the dict with its C++ type
// (torch.jit._pickle.restore_type_tag), a global that weights_only loading refuses. This writes
// the same archive (data.pkl and data/<i>) with an untagged dict, streaming the tensors' bytes
// into the file instead of building the archive in memory.
#pragma once

#include <emakit/detail/config.hpp>

#include <ATen/core/Dict.h>

#include <filesystem>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC void write_tensor_dict(const std::filesystem::path& path, const c10::impl::GenericDict& dict);

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/serial/torch_pickle-inl.hpp>
#endif
