// libFuzzer target: a random c2f::StateDict → serialize_safetensors → parse_safetensors → equal.
//
// The input drives a FuzzedDataProvider that builds the StateDict: up to 8 tensors with names that
// are well-formed UTF-8 (any code point, including NUL, quotes, backslashes and non-BMP ones) or raw
// bytes that may not be; every c2f DType; shapes of rank 0-4 with small dimensions, 0-sized ones and
// scalars [] (plus shapes whose first dimension is 0 and the others huge); the matching bytes; and a
// random "__metadata__" map. The writer must throw SafetensorsError exactly when a name, metadata key
// or value is not well-formed UTF-8 (checked by an independent decoder here) or a tensor is called
// "__metadata__"; otherwise its output must parse to an equal StateDict and re-encode to the same
// bytes. A violation aborts; any exception other than SafetensorsError escapes.
#include "fuzz_common.hpp"

#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr c2f::DType kAllDTypes[] = {c2f::DType::BOOL,    c2f::DType::U8,  c2f::DType::I8,  c2f::DType::F8_E5M2,
                                     c2f::DType::F8_E4M3, c2f::DType::I16, c2f::DType::U16, c2f::DType::F16,
                                     c2f::DType::BF16,    c2f::DType::I32, c2f::DType::U32, c2f::DType::F32,
                                     c2f::DType::I64,     c2f::DType::U64, c2f::DType::F64};

/// Well-formed UTF-8 by decoding (a different method from c2f's table-driven check): no overlong
/// forms, no surrogates, nothing above U+10FFFF, no truncated sequence.
bool well_formed_utf8(const std::string& s) {
  static constexpr std::uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t len = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i < len) return false;
    for (std::size_t k = 1; k < len; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

/// A string for a tensor name or a metadata key/value: mostly well-formed UTF-8, sometimes raw bytes.
std::string make_string(FuzzedDataProvider& p) {
  switch (p.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      return p.ConsumeRandomLengthString(24);  // raw bytes: may be ill-formed UTF-8
    case 1: {
      const std::string pick[] = {"",
                                  "__metadata__",
                                  "weight",
                                  "a.b.c",
                                  "\"",
                                  "\\",
                                  std::string(1, '\0'),
                                  "\xe2\x82\xac",
                                  "\xf0\x9f\x98\x80",
                                  "\xed\xa0\x80",
                                  "\xc0\x80",
                                  "\xff"};
      return pick[p.ConsumeIntegralInRange<std::size_t>(0, std::size(pick) - 1)];
    }
    default: {
      std::string out;
      const int n = p.ConsumeIntegralInRange<int>(0, 12);
      for (int i = 0; i < n; ++i) {
        std::uint32_t cp = 0;
        switch (p.ConsumeIntegralInRange<int>(0, 4)) {
          case 0:
            cp = p.ConsumeIntegralInRange<std::uint32_t>(0, 0x1F);
            break;  // controls, NUL
          case 1:
            cp = p.ConsumeIntegralInRange<std::uint32_t>(0x20, 0x7F);
            break;
          case 2:
            cp = p.ConsumeIntegralInRange<std::uint32_t>(0x80, 0x7FF);
            break;
          case 3:
            cp = p.ConsumeIntegralInRange<std::uint32_t>(0x800, 0xFFFF - 0x800);
            if (cp >= 0xD800) cp += 0x800;  // skip the surrogates
            break;
          default:
            cp = p.ConsumeIntegralInRange<std::uint32_t>(0x10000, 0x10FFFF);
            break;
        }
        append_utf8(out, cp);
      }
      return out;
    }
  }
}

std::vector<std::int64_t> make_shape(FuzzedDataProvider& p) {
  const int rank = p.ConsumeIntegralInRange<int>(0, 4);
  std::vector<std::int64_t> shape;
  if (rank > 0 && p.ConsumeIntegralInRange<int>(0, 15) == 0) {
    // Empty with huge neighbours: the leading 0 keeps the product at 0.
    shape.push_back(0);
    for (int i = 1; i < rank; ++i) {
      shape.push_back(p.ConsumeIntegralInRange<std::int64_t>(0, std::numeric_limits<std::int64_t>::max()));
    }
    return shape;
  }
  for (int i = 0; i < rank; ++i) shape.push_back(p.ConsumeIntegralInRange<std::int64_t>(0, 6));
  return shape;
}

/// For triage (C2F_FUZZ_VERBOSE=1 ./fuzz_safetensors_roundtrip input...): the StateDict an input builds.
void describe(const c2f::StateDict& sd, bool writer_must_fail) {
  std::fprintf(stderr, "StateDict: %zu tensors, %zu metadata entries; the writer must %s\n", sd.size(),
               sd.metadata().size(), writer_must_fail ? "throw" : "succeed");
  for (const auto& [name, t] : sd) {
    std::fprintf(stderr, "  %s: %s %s, %zu bytes\n", c2f::detail::quoted(name).c_str(), c2f::dtype_name(t.dtype()),
                 c2f::detail::shape_string(t.shape()).c_str(), t.bytes().size());
  }
  for (const auto& [key, value] : sd.metadata()) {
    std::fprintf(stderr, "  __metadata__ %s: %s\n", c2f::detail::quoted(key).c_str(),
                 c2f::detail::quoted(value).c_str());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider p(data, size);
  c2f::StateDict sd;

  const int tensors = p.ConsumeIntegralInRange<int>(0, 8);
  for (int i = 0; i < tensors; ++i) {
    std::string name = make_string(p);
    const c2f::DType dtype = kAllDTypes[p.ConsumeIntegralInRange<std::size_t>(0, std::size(kAllDTypes) - 1)];
    std::vector<std::int64_t> shape = make_shape(p);
    // Small dimensions, or a leading 0: the product cannot overflow.
    std::uint64_t nbytes = c2f::dtype_size(dtype);
    for (std::int64_t d : shape) nbytes = (d == 0 || nbytes == 0) ? 0 : nbytes * static_cast<std::uint64_t>(d);
    std::vector<std::uint8_t> bytes = p.ConsumeBytes<std::uint8_t>(static_cast<std::size_t>(nbytes));
    bytes.resize(static_cast<std::size_t>(nbytes), 0x5A);
    sd.set(std::move(name), c2f::TensorData(dtype, std::move(shape), std::move(bytes)));
  }
  const int entries = p.ConsumeIntegralInRange<int>(0, 4);
  for (int i = 0; i < entries; ++i) {
    std::string key = make_string(p);
    std::string value = make_string(p);
    sd.metadata()[std::move(key)] = std::move(value);
  }
  // The writer must fail exactly when a name or metadata string cannot be encoded (decided on the
  // final StateDict: a later set() may have replaced an entry).
  bool writer_must_fail = false;
  for (const auto& [name, t] : sd) {
    if (name == "__metadata__" || !well_formed_utf8(name)) writer_must_fail = true;
  }
  for (const auto& [key, value] : sd.metadata()) {
    if (!well_formed_utf8(key) || !well_formed_utf8(value)) writer_must_fail = true;
  }

  static const bool verbose = std::getenv("C2F_FUZZ_VERBOSE") != nullptr;
  if (verbose) describe(sd, writer_must_fail);

  std::vector<std::uint8_t> encoded;
  try {
    encoded = c2f::serialize_safetensors(sd);
  } catch (const c2f::SafetensorsError& e) {
    C2F_FUZZ_CHECK(writer_must_fail, std::string("the writer rejected an encodable StateDict: ") + e.what());
    return 0;
  }
  C2F_FUZZ_CHECK(!writer_must_fail,
                 "the writer encoded a name or metadata string that is not UTF-8, "
                 "or a tensor called __metadata__");

  c2f_fuzz::check_round_trip(sd, encoded, "parse(serialize(sd)) vs sd");
  return 0;
}
