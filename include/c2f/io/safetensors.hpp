// c2f — reader and writer for the huggingface safetensors format.
//
// A file is: 8 bytes little-endian u64 N, then N bytes of a UTF-8 JSON object (the header, possibly
// padded with trailing spaces), then the byte buffer. Each header entry reads
//   "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
// with offsets relative to the start of the buffer; the optional "__metadata__" entry maps strings to
// strings. The reader validates like the reference Rust implementation (safetensors/src/tensor.rs):
// every malformed input is reported as a SafetensorsError, never a crash or an out-of-bounds read.
#pragma once

#include "c2f/core.hpp"
#include "c2f/state_dict.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

namespace c2f {

/// A malformed safetensors file (or a StateDict that cannot be written as one).
class SafetensorsError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

/// Largest header the reader accepts, as in the reference implementation.
inline constexpr std::uint64_t kSafetensorsMaxHeaderSize = 100'000'000;
inline constexpr const char* kSafetensorsMetadataKey = "__metadata__";

template <class... Parts>
[[noreturn]] void safetensors_fail(const Parts&... parts) {
  std::ostringstream os;
  os << "c2f: safetensors: ";
  (os << ... << parts);
  throw SafetensorsError(os.str());
}

/// Offset of the first byte that is not part of well-formed UTF-8 (Unicode Table 3-7: no overlong
/// forms, no surrogates, nothing above U+10FFFF), or `size` when all of it is well-formed.
inline std::size_t utf8_error_offset(const std::uint8_t* p, std::size_t size) {
  std::size_t i = 0;
  while (i < size) {
    const std::uint8_t c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    std::uint8_t lo = 0x80;
    std::uint8_t hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c == 0xE0) {
      len = 3;
      lo = 0xA0;
    } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
      len = 3;
    } else if (c == 0xED) {
      len = 3;
      hi = 0x9F;
    } else if (c == 0xF0) {
      len = 4;
      lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF3) {
      len = 4;
    } else if (c == 0xF4) {
      len = 4;
      hi = 0x8F;
    } else {
      return i;
    }
    if (size - i < len) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (std::size_t k = 2; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
    }
    i += len;
  }
  return size;
}

inline bool is_utf8(const std::string& s) {
  return utf8_error_offset(reinterpret_cast<const std::uint8_t*>(s.data()), s.size()) == s.size();
}

/// `s` as a JSON string literal, escaped and cut to `max_bytes`, for error messages (file contents
/// may be huge or hold control characters).
inline std::string quoted(const std::string& s, std::size_t max_bytes = 200) {
  const bool cut = s.size() > max_bytes;
  const nlohmann::json j = cut ? s.substr(0, max_bytes) : s;
  std::string out = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (cut) out += "...";
  return out;
}

inline void json_excerpt_into(const nlohmann::json& j, int depth, std::size_t max_bytes, std::string& out) {
  if (out.size() > max_bytes) return;
  if (j.is_string()) {
    out += quoted(j.get_ref<const std::string&>(), max_bytes);
  } else if (j.is_array() || j.is_object()) {
    const bool array = j.is_array();
    if (depth == 0 && !j.empty()) {
      out += array ? "[...]" : "{...}";
      return;
    }
    out += array ? '[' : '{';
    bool first = true;
    for (auto it = j.begin(); it != j.end() && out.size() <= max_bytes; ++it) {
      if (!first) out += ',';
      first = false;
      if (!array) out += quoted(it.key(), max_bytes) + ':';
      json_excerpt_into(*it, depth - 1, max_bytes, out);
    }
    out += array ? ']' : '}';
  } else {
    out += j.dump();
  }
}

/// A JSON value as compact text for error messages: cut to about `max_bytes`, and nested at most a few
/// levels deep (nlohmann's dump recurses, and a header may nest arrays 10^7 levels deep).
inline std::string json_excerpt(const nlohmann::json& j, std::size_t max_bytes = 200) {
  std::string out;
  json_excerpt_into(j, 4, max_bytes, out);
  if (out.size() > max_bytes) out = out.substr(0, max_bytes) + "...";
  return out;
}

inline std::string u64_pair_string(std::uint64_t a, std::uint64_t b) {
  std::ostringstream os;
  os << '[' << a << ", " << b << ']';
  return os.str();
}

/// A JSON integer ≥ 0 (nlohmann keeps "-0" as a signed zero), as u64.
inline std::optional<std::uint64_t> json_non_negative_integer(const nlohmann::json& j) {
  if (j.is_number_unsigned()) return j.get<std::uint64_t>();
  if (j.is_number_integer()) {
    const auto v = j.get<std::int64_t>();
    if (v >= 0) return static_cast<std::uint64_t>(v);
  }
  return std::nullopt;
}

/// Most nested arrays/objects a header may open, as serde_json's default recursion limit in the
/// reference reader. Real headers nest three deep; the bound keeps adversarial ones from costing
/// gigabytes of DOM.
inline constexpr std::size_t kSafetensorsMaxJsonDepth = 128;

/// A SAX pass over the header before building the DOM: syntax errors, nesting depth and duplicate
/// keys (nlohmann's DOM silently keeps the last duplicate; other readers may resolve such an ambiguous
/// header differently).
class SafetensorsHeaderScanner final : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool null() override { return true; }
  bool boolean(bool /*val*/) override { return true; }
  bool number_integer(number_integer_t /*val*/) override { return true; }
  bool number_unsigned(number_unsigned_t /*val*/) override { return true; }
  bool number_float(number_float_t /*val*/, const string_t& /*s*/) override { return true; }
  bool string(string_t& /*val*/) override { return true; }
  bool binary(binary_t& /*val*/) override { return true; }
  bool start_object(std::size_t /*elements*/) override {
    open_objects_.emplace_back();
    return enter();
  }
  bool key(string_t& val) override {
    if (!open_objects_.back().insert(val).second) {
      duplicate_ = val;
      duplicate_depth_ = open_objects_.size();
      return false;
    }
    return true;
  }
  bool end_object() override {
    open_objects_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t /*elements*/) override { return enter(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const nlohmann::json::exception& ex) override {
    syntax_error_ = ex.what();
    return false;
  }

  /// Throws SafetensorsError for whatever stopped the scan.
  [[noreturn]] void fail() const {
    if (syntax_error_) safetensors_fail("header is not valid JSON: ", *syntax_error_);
    if (too_deep_) {
      safetensors_fail("header JSON nests arrays/objects deeper than ", kSafetensorsMaxJsonDepth, " levels");
    }
    if (duplicate_) {
      if (duplicate_depth_ == 1) {
        safetensors_fail("header lists ", quoted(*duplicate_), " more than once (duplicate JSON key)");
      }
      safetensors_fail("header repeats the JSON key ", quoted(*duplicate_), " inside one object (nesting depth ",
                       duplicate_depth_, ")");
    }
    safetensors_fail("header is not valid JSON");
  }

 private:
  bool enter() {
    if (++depth_ > kSafetensorsMaxJsonDepth) {
      too_deep_ = true;
      return false;
    }
    return true;
  }

  std::size_t depth_ = 0;
  bool too_deep_ = false;
  std::vector<std::unordered_set<std::string>> open_objects_;
  std::optional<std::string> duplicate_;
  std::size_t duplicate_depth_ = 0;
  std::optional<std::string> syntax_error_;
};

/// Parses the header JSON after SafetensorsHeaderScanner accepted it.
inline nlohmann::json parse_safetensors_header_json(const char* first, const char* last) {
  SafetensorsHeaderScanner scanner;
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(first, last, &scanner, nlohmann::json::input_format_t::json,
                                   /*strict=*/true, /*ignore_comments=*/false);
  } catch (const nlohmann::json::exception& e) {
    safetensors_fail("header is not valid JSON: ", e.what());
  }
  if (!ok) scanner.fail();
  try {
    return nlohmann::json::parse(first, last, /*cb=*/nullptr, /*allow_exceptions=*/true,
                                 /*ignore_comments=*/false);
  } catch (const nlohmann::json::exception& e) {
    safetensors_fail("header is not valid JSON: ", e.what());
  }
}

inline std::map<std::string, std::string> parse_safetensors_metadata(const nlohmann::json& j) {
  if (!j.is_object()) {
    safetensors_fail("\"", kSafetensorsMetadataKey, "\" must be an object mapping strings to strings, got ",
                     j.type_name(), " ", json_excerpt(j));
  }
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : j.items()) {
    if (!value.is_string()) {
      safetensors_fail("\"", kSafetensorsMetadataKey, "\" must map strings to strings, but key ", quoted(key),
                       " holds a ", value.type_name(), ": ", json_excerpt(value));
    }
    out.emplace(key, value.get<std::string>());
  }
  return out;
}

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint64_t nbytes = 0;  // numel(shape) × dtype_size(dtype)
};

inline SafetensorsEntry parse_safetensors_entry(const std::string& name, const nlohmann::json& j) {
  const std::string tensor = "tensor " + quoted(name);
  if (!j.is_object()) {
    safetensors_fail(tensor, ": header entry must be an object with \"dtype\", \"shape\" and \"data_offsets\", got ",
                     j.type_name(), " ", json_excerpt(j));
  }
  SafetensorsEntry e;
  e.name = name;

  const auto dtype_it = j.find("dtype");
  if (dtype_it == j.end()) safetensors_fail(tensor, ": header entry has no \"dtype\"");
  if (!dtype_it->is_string()) {
    safetensors_fail(tensor, ": \"dtype\" must be a string, got ", dtype_it->type_name(), " ", json_excerpt(*dtype_it));
  }
  const std::string& dtype_str = dtype_it->get_ref<const std::string&>();
  const std::optional<DType> dtype = dtype_from_name(dtype_str);
  if (!dtype) {
    safetensors_fail(tensor, ": unknown dtype ", quoted(dtype_str),
                     " (supported: BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, I64, U64, "
                     "F64)");
  }
  e.dtype = *dtype;

  const auto shape_it = j.find("shape");
  if (shape_it == j.end()) safetensors_fail(tensor, ": header entry has no \"shape\"");
  if (!shape_it->is_array()) {
    safetensors_fail(tensor, ": \"shape\" must be an array of non-negative integers, got ", shape_it->type_name(), " ",
                     json_excerpt(*shape_it));
  }
  e.shape.reserve(shape_it->size());
  for (const nlohmann::json& d : *shape_it) {
    const std::optional<std::uint64_t> v = json_non_negative_integer(d);
    if (!v) {
      safetensors_fail(tensor, ": \"shape\" must be an array of non-negative integers, got ", json_excerpt(*shape_it),
                       " (element ", json_excerpt(d), ")");
    }
    if (*v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      safetensors_fail(tensor, ": shape dimension ", *v, " in ", json_excerpt(*shape_it),
                       " does not fit a signed 64-bit integer");
    }
    e.shape.push_back(static_cast<std::int64_t>(*v));
  }

  const auto offsets_it = j.find("data_offsets");
  if (offsets_it == j.end()) safetensors_fail(tensor, ": header entry has no \"data_offsets\"");
  std::optional<std::uint64_t> begin;
  std::optional<std::uint64_t> end;
  if (offsets_it->is_array() && offsets_it->size() == 2) {
    begin = json_non_negative_integer((*offsets_it)[0]);
    end = json_non_negative_integer((*offsets_it)[1]);
  }
  if (!begin || !end) {
    safetensors_fail(tensor, ": \"data_offsets\" must be an array of exactly two non-negative integers, got ",
                     json_excerpt(*offsets_it));
  }
  e.begin = *begin;
  e.end = *end;

  // Bound the element count so that numel × dtype_size cannot wrap (a plain product of [2^32, 2^32]
  // would wrap to 0 and look like an empty tensor).
  const std::uint64_t elem = dtype_size(e.dtype);
  const std::optional<std::uint64_t> numel = checked_numel(e.shape);  // left to right, as the reference
  if (!numel || *numel > std::numeric_limits<std::uint64_t>::max() / elem) {
    safetensors_fail(tensor, ": shape ", shape_string(e.shape), " of dtype ", dtype_name(e.dtype),
                     " overflows (the byte count numel × ", elem, " does not fit 64 bits)");
  }
  e.nbytes = *numel * elem;
  // A shape with a 0 holds nothing, whatever its other dimensions (the reference reader accepts
  // [2, 2^62, 0, 1]); every use of a shape in c2f checks its own products (c2f/core.hpp).
  return e;
}

inline std::uint64_t read_u64_le(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

/// The header text (JSON padded with spaces to a multiple of 8 bytes) for `sd`, tensors in name order.
/// Each piece is encoded by nlohmann; the object is assembled here because nlohmann's ordered_json
/// inserts keys by linear search, quadratic in the number of tensors.
inline std::string safetensors_header(const StateDict& sd) {
  std::string text = "{";
  try {
    if (!sd.metadata().empty()) {
      nlohmann::json meta = nlohmann::json::object();
      for (const auto& [key, value] : sd.metadata()) {
        if (!is_utf8(key)) safetensors_fail("metadata key ", quoted(key), " is not valid UTF-8");
        if (!is_utf8(value)) {
          safetensors_fail("metadata value ", quoted(value), " of key ", quoted(key), " is not valid UTF-8");
        }
        meta[key] = value;
      }
      text += nlohmann::json(kSafetensorsMetadataKey).dump() + ':' + meta.dump();
    }
    std::uint64_t offset = 0;
    for (const auto& [name, t] : sd) {
      if (name == kSafetensorsMetadataKey) {
        safetensors_fail("cannot write a tensor named \"", kSafetensorsMetadataKey,
                         "\": the name is reserved for the metadata");
      }
      if (!is_utf8(name)) safetensors_fail("tensor name ", quoted(name), " is not valid UTF-8");
      // TensorData's constructor guarantees bytes().size() == numel(shape) × dtype_size.
      const std::uint64_t end = offset + t.bytes().size();
      nlohmann::ordered_json entry = nlohmann::ordered_json::object();
      entry["dtype"] = dtype_name(t.dtype());
      entry["shape"] = nlohmann::ordered_json(t.shape());
      entry["data_offsets"] = nlohmann::ordered_json::array({offset, end});
      if (text.size() > 1) text += ',';
      text += nlohmann::json(name).dump() + ':' + entry.dump();
      offset = end;
    }
  } catch (const nlohmann::json::exception& e) {
    safetensors_fail("cannot encode the header: ", e.what());
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

inline std::string errno_suffix(int err) { return err != 0 ? std::string(": ") + std::strerror(err) : std::string(); }

}  // namespace detail

/// Parses a whole safetensors file held in memory. Throws SafetensorsError on any malformed input.
inline StateDict parse_safetensors(const std::uint8_t* data, std::size_t size) {
  if (data == nullptr && size != 0) detail::safetensors_fail("null data pointer with size ", size);
  if (size < 8) {
    detail::safetensors_fail("header too small: the data holds ", size, " bytes, fewer than the 8-byte header length");
  }
  const std::uint64_t n = detail::read_u64_le(data);
  if (n > detail::kSafetensorsMaxHeaderSize) {
    detail::safetensors_fail("header too large: its length field says ", n, " bytes, above the limit of ",
                             detail::kSafetensorsMaxHeaderSize);
  }
  if (n > size - 8) {
    detail::safetensors_fail("invalid header length: 8 + ", n, " header bytes run past the end of the data (", size,
                             " bytes)");
  }
  const std::uint8_t* header_begin = data + 8;
  const auto header_size = static_cast<std::size_t>(n);
  const std::size_t bad = detail::utf8_error_offset(header_begin, header_size);
  if (bad != header_size) {
    std::ostringstream byte;
    byte << "0x" << std::hex << static_cast<unsigned>(header_begin[bad]);
    detail::safetensors_fail("header is not valid UTF-8 (ill-formed byte ", byte.str(), " at header offset ", bad, ")");
  }
  const nlohmann::json header = detail::parse_safetensors_header_json(
      reinterpret_cast<const char*>(header_begin), reinterpret_cast<const char*>(header_begin + header_size));
  if (!header.is_object()) {
    detail::safetensors_fail("header JSON must be an object, got ", header.type_name(), " ",
                             detail::json_excerpt(header));
  }

  StateDict sd;
  std::vector<detail::SafetensorsEntry> entries;
  entries.reserve(header.size());
  for (const auto& [key, value] : header.items()) {
    if (key == detail::kSafetensorsMetadataKey) {
      sd.metadata() = detail::parse_safetensors_metadata(value);
    } else {
      entries.push_back(detail::parse_safetensors_entry(key, value));
    }
  }

  // The tensors, in offset order, must tile the buffer from 0 without gap or overlap.
  std::sort(entries.begin(), entries.end(), [](const detail::SafetensorsEntry& a, const detail::SafetensorsEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  std::uint64_t buffer_end = 0;
  const detail::SafetensorsEntry* previous = nullptr;
  for (const detail::SafetensorsEntry& e : entries) {
    const std::string tensor = "tensor " + detail::quoted(e.name);
    const std::string offsets = detail::u64_pair_string(e.begin, e.end);
    if (e.end < e.begin) {
      detail::safetensors_fail("invalid offset: ", tensor, " has data_offsets ", offsets,
                               " that end before they begin");
    }
    if (e.begin != buffer_end) {
      if (previous == nullptr) {
        detail::safetensors_fail("invalid offset: ", tensor, " has data_offsets ", offsets,
                                 " but the first tensor must begin at byte 0 of the buffer");
      }
      detail::safetensors_fail("invalid offset: ", tensor, " has data_offsets ", offsets, " but must begin at byte ",
                               buffer_end, " where tensor ", detail::quoted(previous->name), " (data_offsets ",
                               detail::u64_pair_string(previous->begin, previous->end), ") ends",
                               e.begin < buffer_end ? " (overlap)" : " (gap)");
    }
    if (e.end - e.begin != e.nbytes) {
      detail::safetensors_fail(tensor, " of dtype ", dtype_name(e.dtype), " and shape ", detail::shape_string(e.shape),
                               " needs ", e.nbytes, " bytes, but its data_offsets ", offsets, " span ",
                               e.end - e.begin);
    }
    buffer_end = e.end;
    previous = &e;
  }
  const std::uint64_t buffer_size = static_cast<std::uint64_t>(size) - 8 - n;
  if (buffer_end != buffer_size) {
    detail::safetensors_fail("incomplete buffer: the tensors cover ", buffer_end, " bytes but the data holds ",
                             buffer_size, " bytes after the ", n, "-byte header",
                             buffer_end < buffer_size ? " (trailing bytes)" : " (buffer too short)");
  }

  const std::uint8_t* buffer = header_begin + header_size;
  for (detail::SafetensorsEntry& e : entries) {
    std::vector<std::uint8_t> bytes(buffer + static_cast<std::size_t>(e.begin),
                                    buffer + static_cast<std::size_t>(e.end));
    sd.set(std::move(e.name), TensorData(e.dtype, std::move(e.shape), std::move(bytes)));
  }
  return sd;
}

/// Reads the whole file at `path` and parses it. An unreadable file throws std::runtime_error naming
/// the path; a malformed one throws SafetensorsError.
inline StateDict load_safetensors(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw std::runtime_error("c2f: cannot read safetensors file '" + path + "': it is a directory");
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("c2f: cannot open safetensors file '" + path + "'" + detail::errno_suffix(errno));
  }
  std::vector<std::uint8_t> bytes;
  const std::uintmax_t hint = std::filesystem::file_size(path, ec);
  if (!ec && hint <= std::numeric_limits<std::size_t>::max() / 2) bytes.reserve(static_cast<std::size_t>(hint));
  char chunk[1 << 16];
  while (in) {
    in.read(chunk, sizeof(chunk));
    bytes.insert(bytes.end(), chunk, chunk + in.gcount());
  }
  if (in.bad()) {
    throw std::runtime_error("c2f: error while reading safetensors file '" + path + "'" + detail::errno_suffix(errno));
  }
  try {
    return parse_safetensors(bytes.data(), bytes.size());
  } catch (const SafetensorsError& e) {
    throw SafetensorsError(std::string(e.what()) + " (in '" + path + "')");
  }
}

/// Encodes `sd` as a safetensors file: tensors in name order with contiguous offsets from 0,
/// "__metadata__" when non-empty, header padded with spaces to a multiple of 8 bytes.
inline std::vector<std::uint8_t> serialize_safetensors(const StateDict& sd) {
  const std::string header = detail::safetensors_header(sd);
  std::size_t total = 8 + header.size();
  for (const auto& entry : sd) total += entry.second.bytes().size();
  std::vector<std::uint8_t> out;
  out.reserve(total);
  const auto n = static_cast<std::uint64_t>(header.size());
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(n >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  for (const auto& entry : sd) out.insert(out.end(), entry.second.bytes().begin(), entry.second.bytes().end());
  return out;
}

/// Writes `sd` to `path` (see serialize_safetensors). A write failure throws std::runtime_error naming
/// the path; a StateDict that cannot be encoded throws SafetensorsError before the file is touched.
inline void save_safetensors(const std::string& path, const StateDict& sd) {
  const std::vector<std::uint8_t> bytes = serialize_safetensors(sd);
  errno = 0;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    throw std::runtime_error("c2f: cannot open '" + path + "' for writing" + detail::errno_suffix(errno));
  }
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) {
    throw std::runtime_error("c2f: error while writing safetensors file '" + path + "'" + detail::errno_suffix(errno));
  }
}

}  // namespace c2f
