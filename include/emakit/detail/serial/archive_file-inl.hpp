// The non-template definitions of archive_file.hpp: included at the end of archive_file.hpp in header-only mode,
// compiled once into the emakit library (src/emakit.cpp) in compiled mode (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/archive_file-inl.hpp holds definitions that the emakit library compiles in compiled mode (EMAKIT_COMPILED): include <emakit/detail/serial/archive_file.hpp> instead"
#endif

#include <emakit/detail/serial/archive_file.hpp>

#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/archive_scan.hpp>
#include <emakit/detail/serial/atomic_file.hpp>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC void check_checkpoint_path(const std::filesystem::path& path, const char* what) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (status.type() == std::filesystem::file_type::not_found)
    fail("{}: no file '{}': the path does not exist", what, path.string());
  if (ec) fail("{}: cannot read '{}': {}", what, path.string(), ec.message());
  if (status.type() == std::filesystem::file_type::directory)
    fail("{}: '{}' is a directory, not a checkpoint file; give the path of the file in it", what, path.string());
  if (status.type() != std::filesystem::file_type::regular)
    fail("{}: '{}' is not a regular file, not a checkpoint file", what, path.string());
}

namespace archive_file {

// Python's torch.save(model.state_dict()) pickles (protocol 2, torch.save's) an OrderedDict:
//   PROTO 2, GLOBAL 'collections OrderedDict', BINPUT 0, EMPTY_TUPLE, REDUCE, BINPUT 1,
//   the items (MARK key value ... SETITEMS, in batches of 1000; a batch of one is key value
//   SETITEM), then its _metadata: a dict, BUILD, STOP.
// LibTorch's unpickler (1.13 and 2.x alike) makes OrderedDict() None (it knows that global only
// as a tensor's empty backward hooks) and then fails on the items with an internal assert; it
// reads neither SETITEM nor BUILD on a dict. plain_root rewrites such a pickle into the plain
// dict it holds, with opcodes that unpickler reads:
//   PROTO 2, EMPTY_DICT, MARK, BINUNICODE placeholder, GLOBAL 'collections OrderedDict',
//   BINPUT 0, EMPTY_TUPLE, REDUCE, SETITEMS, BINPUT 1 (the global stays memoized at 0 for the
//   tensors that name it; the placeholder key holds the None it makes and is removed after
//   unpickling), the items with each root-level SETITEM made MARK key value SETITEMS, and no
//   _metadata (its BUILD and the dict before it are dropped). A plain dict's root-level SETITEM
//   (a dict of one entry, or 1000k + 1) is made MARK key value SETITEMS too.
// An OrderedDict inside the dict (a Lightning checkpoint's current_model_state: a model's
// state_dict()) is made a plain dict too, with opcodes LibTorch reads (it has no POP): the
// OrderedDict() that receives items (SETITEM(S)) or its _metadata (BUILD) becomes EMPTY_DICT,
// MARK, BINUNICODE nested_placeholder, <the global> EMPTY_TUPLE REDUCE (None), SETITEMS (the global
// stays memoized), and its BUILD becomes MARK nested_placeholder <the _metadata> SETITEMS; the
// placeholder key is removed from every dict after unpickling. OrderedDict() with neither, a
// tensor's empty backward hooks, stays as it is. Every SETITEM, at any depth, becomes MARK key
// value SETITEMS, and every APPEND MARK value APPENDS.
// The pickle was scanned first (archive_scan.hpp); a pickle this does not recognize is returned
// unchanged (LibTorch then reads it or fails, and read_pickle_dict says so).
constexpr std::string_view ordered_dict_root{"\x80\x02"
                                             "ccollections\nOrderedDict\nq\x00)Rq\x01",
                                             33};
constexpr std::string_view placeholder{"\0emakit:OrderedDict\0", 20};
constexpr std::string_view nested_placeholder{"\0emakit:NestedOrderedDict\0", 26};

// MARK, BINUNICODE nested_placeholder.
inline std::string mark_nested_placeholder() {
  std::string out("(X", 2);
  const auto n = static_cast<std::uint32_t>(nested_placeholder.size());
  for (int byte = 0; byte < 4; ++byte) out += static_cast<char>((n >> (8 * byte)) & 0xFF);  // little-endian
  out += nested_placeholder;
  return out;
}

struct Edit {
  std::size_t at;       // offset in the original pickle
  std::size_t removed;  // bytes removed there
  std::string inserted;
};

// The edits that make an OrderedDict root a plain dict (the first one adds the placeholder), or a
// plain dict root's SETITEM a SETITEMS; nullopt when `p` is neither or not a pickle this reads.
inline std::optional<std::vector<Edit>> plain_root_edits(std::string_view p) {
  std::vector<Edit> edits;
  std::size_t i = 3;  // a plain dict: PROTO 2, EMPTY_DICT, then BINPUT and the items
  if (p.substr(0, ordered_dict_root.size()) == ordered_dict_root) {
    std::string prefix("\x80\x02}(X", 5);
    const auto n = static_cast<std::uint32_t>(placeholder.size());
    for (int byte = 0; byte < 4; ++byte) prefix += static_cast<char>((n >> (8 * byte)) & 0xFF);  // little-endian
    prefix += placeholder;
    prefix += ordered_dict_root.substr(2, 29);  // GLOBAL, BINPUT 0, EMPTY_TUPLE, REDUCE
    prefix += 'u';                              // SETITEMS
    prefix += ordered_dict_root.substr(31);     // BINPUT 1
    edits.push_back({0, ordered_dict_root.size(), prefix});
    i = ordered_dict_root.size();
  } else if (p.substr(0, 3) != std::string_view("\x80\x02}", 3)) {
    return std::nullopt;
  }
  // The stack: each entry the offset where the code of its value begins; marks are flagged.
  enum class Kind : std::uint8_t { other, ordered_global, empty_tuple, ordered_dict };
  struct Entry {
    std::size_t start;
    bool mark;
    Kind kind = Kind::other;
    std::size_t made = 0;  // ordered_dict: the offset after its REDUCE
    bool plain = false;    // ordered_dict: already given POP, EMPTY_DICT
  };
  std::vector<Entry> stack{{0, false}};  // the root
  std::map<std::size_t, Kind> memo;      // memo slots that hold the OrderedDict global
  // A nested OrderedDict (not the root, which the first edit handles) made a plain dict.
  auto make_plain = [&](Entry& e) {
    if (e.kind != Kind::ordered_dict || e.plain) return;
    edits.push_back({e.start, 0, "}" + mark_nested_placeholder()});
    edits.push_back({e.made, 0, "u"});
    e.plain = true;
  };
  // The container SETITEMS/APPENDS fills: the entry under the topmost mark.
  auto below_mark = [&]() -> Entry* {
    for (std::size_t k = stack.size(); k-- > 1;)
      if (stack[k].mark) return &stack[k - 1];
    return nullptr;
  };
  auto pop_to_mark = [&]() -> std::optional<std::size_t> {
    while (!stack.empty() && !stack.back().mark) stack.pop_back();
    if (stack.empty()) return std::nullopt;
    const std::size_t start = stack.back().start;
    stack.pop_back();
    return start;
  };
  auto pop_n = [&](std::size_t k) -> std::optional<std::size_t> {  // k values; the first one's start
    if (stack.size() < k) return std::nullopt;
    const std::size_t start = stack[stack.size() - k].start;
    for (std::size_t i = 0; i < k; ++i) {
      if (stack.back().mark) return std::nullopt;
      stack.pop_back();
    }
    return start;
  };
  auto u32 = [&](std::size_t at) -> std::optional<std::size_t> {
    if (at + 4 > p.size()) return std::nullopt;
    std::uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[at + i]);
    return v;
  };
  while (i < p.size()) {
    const std::size_t at = i;
    const auto op = static_cast<unsigned char>(p[i++]);
    std::size_t arg = 0;  // bytes after the opcode
    bool push = false;
    Kind kind = Kind::other;  // of the value pushed
    switch (op) {
      case 'q':    // BINPUT
      case 'r': {  // LONG_BINPUT
        arg = op == 'q' ? 1 : 4;
        const auto slot =
            op == 'q' ? std::optional<std::size_t>(i < p.size() ? static_cast<unsigned char>(p[i]) : 0) : u32(i);
        if (!slot || stack.empty()) return std::nullopt;
        memo[*slot] = stack.back().kind == Kind::ordered_global ? Kind::ordered_global : Kind::other;
        break;
      }
      case 'h':    // BINGET
      case 'j': {  // LONG_BINGET
        arg = op == 'h' ? 1 : 4;
        push = true;
        const auto slot =
            op == 'h' ? std::optional<std::size_t>(i < p.size() ? static_cast<unsigned char>(p[i]) : 0) : u32(i);
        if (!slot) return std::nullopt;
        if (const auto it = memo.find(*slot); it != memo.end()) kind = it->second;
        break;
      }
      case 'K':
        arg = 1;
        push = true;
        break;  // BININT1
      case 'M':
        arg = 2;
        push = true;
        break;  // BININT2
      case 'J':
        arg = 4;
        push = true;
        break;  // BININT
      case 'G':
        arg = 8;
        push = true;
        break;  // BINFLOAT
      case ')':
        push = true;
        kind = Kind::empty_tuple;
        break;
      case '}':
      case ']':
      case 'N':
      case 0x88:
      case 0x89: push = true; break;
      case 0x8a:
      case 'U':
      case 'C':  // LONG1, SHORT_BINSTRING, SHORT_BINBYTES
        if (i >= p.size()) return std::nullopt;
        arg = 1 + static_cast<unsigned char>(p[i]);
        push = true;
        break;
      case 'X':
      case 'T':
      case 'B': {  // BINUNICODE, BINSTRING, BINBYTES
        const auto len = u32(i);
        if (!len) return std::nullopt;
        arg = 4 + *len;
        push = true;
        break;
      }
      case 'c': {  // GLOBAL module\nname\n
        const auto first = p.find('\n', i);
        const auto second = first == std::string_view::npos ? first : p.find('\n', first + 1);
        if (second == std::string_view::npos) return std::nullopt;
        arg = second + 1 - i;
        push = true;
        if (p.substr(i, arg) == "collections\nOrderedDict\n") kind = Kind::ordered_global;
        break;
      }
      case '(': stack.push_back({at, true}); break;  // MARK
      case 't':
      case 'l':
      case 'd': {  // TUPLE, LIST, DICT
        const auto start = pop_to_mark();
        if (!start) return std::nullopt;
        stack.push_back({*start, false});
        break;
      }
      case 'u':
      case 'e':  // SETITEMS, APPENDS: the container stays
        if (Entry* target = below_mark(); op == 'u' && target != nullptr) make_plain(*target);
        if (!pop_to_mark() || stack.empty()) return std::nullopt;
        break;
      case 0x85:
      case 0x86:
      case 0x87:
      case 'R':
      case 0x81:
      case 'Q': {  // TUPLE1-3, REDUCE, NEWOBJ, BINPERSID
        const std::size_t k = op == 'Q' ? 1 : op == 'R' || op == 0x81 ? 2 : std::size_t{op} - 0x84;
        const bool ordered = op == 'R' && stack.size() >= 3 && stack[stack.size() - 2].kind == Kind::ordered_global &&
                             stack.back().kind == Kind::empty_tuple;
        const auto start = pop_n(k);
        if (!start) return std::nullopt;
        stack.push_back({*start, false, ordered ? Kind::ordered_dict : Kind::other, i});
        break;
      }
      case 'a':  // APPEND: MARK value APPENDS
        if (stack.size() >= 3 && !stack.back().mark) {
          edits.push_back({stack.back().start, 0, "("});
          edits.push_back({at, 1, "e"});
        }
        if (!pop_n(1) || stack.empty()) return std::nullopt;
        break;
      case 's':  // SETITEM, on the root or inside: MARK k v SETITEMS
        if (stack.size() >= 3 && !stack[stack.size() - 1].mark && !stack[stack.size() - 2].mark) {
          edits.push_back({stack[stack.size() - 2].start, 0, "("});
          edits.push_back({at, 1, "u"});
        }
        if (stack.size() >= 4) make_plain(stack[stack.size() - 3]);
        if (!pop_n(2) || stack.empty()) return std::nullopt;
        break;
      case 'b':                                     // BUILD
        if (stack.size() == 2 && !stack[1].mark) {  // the root's _metadata: dropped, with the edits inside it
          const std::size_t from = stack[1].start;
          std::erase_if(edits, [&](const Edit& e) { return e.at >= from && e.at <= at; });
          edits.push_back({from, at + 1 - from, ""});
        } else if (stack.size() >= 3 && stack[stack.size() - 2].kind == Kind::ordered_dict) {
          // A nested OrderedDict's _metadata: set under the placeholder key, removed after unpickling.
          make_plain(stack[stack.size() - 2]);
          edits.push_back({stack.back().start, 0, mark_nested_placeholder()});
          edits.push_back({at, 1, "u"});
        }
        if (!pop_n(1) || stack.empty()) return std::nullopt;
        break;
      case '.':  // STOP
        if (stack.size() != 1 || i != p.size() || edits.empty()) return std::nullopt;
        return edits;
      default: return std::nullopt;  // an opcode torch.save's pickles do not use
    }
    if (push) stack.push_back({at, false, kind});
    i += arg;
    if (i > p.size()) return std::nullopt;
  }
  return std::nullopt;  // no STOP
}

// `pickle` with an OrderedDict root made a plain dict, or a plain dict root's SETITEM made a
// SETITEMS (see above); nullopt when it needs neither.
inline std::optional<std::string> plain_root(std::string_view pickle) {
  auto edits = plain_root_edits(pickle);
  if (!edits) return std::nullopt;
  std::stable_sort(edits->begin(), edits->end(), [](const Edit& a, const Edit& b) { return a.at < b.at; });
  std::string out;
  std::size_t copied = 0;
  for (const auto& e : *edits) {
    if (e.at < copied) return std::nullopt;  // overlapping edits: not a pickle this reads
    out.append(pickle.substr(copied, e.at - copied));
    out += e.inserted;
    copied = e.at + e.removed;
  }
  out.append(pickle.substr(copied));
  return out;
}

// Removes nested_placeholder's key from every dict inside `v` (see plain_root_edits).
inline void drop_nested_placeholders(const c10::IValue& v) {
  if (v.isGenericDict()) {
    auto d = v.toGenericDict();
    static_cast<void>(d.erase(c10::IValue(std::string(nested_placeholder))));  // absent in most dicts
    for (const auto& item : d) drop_nested_placeholders(item.value());
  } else if (v.isList()) {
    for (const auto& item : v.toListRef()) drop_nested_placeholders(item);
  } else if (v.isTuple()) {
    for (const auto& item : v.toTupleRef().elements()) drop_nested_placeholders(item);
  }
}

}  // namespace archive_file

EMAKIT_FUNC void read_archive(torch::serialize::InputArchive& archive, const std::filesystem::path& path,
                              const char* what) {
  check_checkpoint_path(path, what);
  scan_archive_file(path, what);
  try {
    archive.load_from(path.string());
  } catch (const std::exception& e) {
    fail("{}: '{}' is not a readable checkpoint (truncated or damaged?): {}", what, path.string(),
         first_line(e.what()));
  }
}

EMAKIT_FUNC void write_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& path) {
  std::ostringstream bytes;
  archive.save_to(bytes);
  const std::string data = bytes.str();
  write_file_atomically(path, std::span<const char>(data.data(), data.size()));
}

EMAKIT_FUNC c10::impl::GenericDict read_pickle_dict(const std::filesystem::path& path, const char* what) {
  check_checkpoint_path(path, what);
  scan_archive_file(path, what, archive_scan::Root::dict);
  const std::string plain_dict = "save a plain dict: torch.save(dict(ema.state_dict()), path)";
  c10::IValue value;
  bool ordered = false;  // the root was an OrderedDict, read as a plain dict
  try {
    caffe2::serialize::PyTorchStreamReader zip(path.string());
    auto [data, size] = zip.getRecord("data.pkl");
    const std::string_view saved(static_cast<const char*>(data.get()), size);
    const std::optional<std::string> plain = archive_file::plain_root(saved);
    const bool ordered_root = saved.substr(0, 27) == archive_file::ordered_dict_root.substr(0, 27);
    if (!plain && ordered_root)
      fail("{}: '{}' holds an OrderedDict that emakit cannot read (torch.save's protocol 2 expected); {}", what,
           path.string(), plain_dict);
    ordered = plain.has_value() && ordered_root;
    // torch::jit::pickle_load's steps (readArchiveAndTensors), on the reader the check opened.
    const std::string_view pickle = plain ? std::string_view(*plain) : saved;
    std::size_t at = 0;
    std::function<std::size_t(char*, std::size_t)> reader = [&](char* buffer, std::size_t n) {
      n = std::min(n, pickle.size() - at);
      std::memcpy(buffer, pickle.data() + at, n);
      at += n;
      return n;
    };
    std::function<at::DataPtr(const std::string&)> record = [&](const std::string& name) {
      return std::get<0>(zip.getRecord("data/" + name));
    };
    torch::jit::Unpickler unpickler(std::move(reader), torch::jit::TypeResolver{}, torch::jit::ObjLoader{},
                                    std::move(record), {});
    unpickler.set_version(zip.version());
    value = unpickler.parse_ivalue();
  } catch (const c10::Error& e) {
    // A nested OrderedDict (a dict whose value is a state_dict()) is None to LibTorch: its items
    // then fail on an internal assert.
    if (std::string_view(e.what_without_backtrace()).find("isGenericDict()") != std::string_view::npos)
      fail("{}: '{}' holds an OrderedDict inside its dict, which LibTorch cannot read; {}", what, path.string(),
           plain_dict);
    fail("{}: '{}' is not a file torch.save wrote with a dict of tensors: {}; {}", what, path.string(), first_line(e),
         plain_dict);
  }
  if (!value.isGenericDict())  // the scan accepts a dict only; kept for a reader that changes
    fail("{}: '{}' holds a {}, not a dict", what, path.string(), value.tagKind());
  auto dict = value.toGenericDict();
  if (ordered) {
    const c10::IValue placeholder{std::string(archive_file::placeholder)};
    const auto it = dict.find(placeholder);
    if (it == dict.end() || !it->value().isNone())  // the file held a key equal to the placeholder
      fail("{}: '{}' holds a key emakit reserves for reading an OrderedDict; {}", what, path.string(), plain_dict);
    dict.erase(it);
  }
  archive_file::drop_nested_placeholders(value);
  return dict;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
