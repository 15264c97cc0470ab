// libFuzzer target: raw bytes → c2f::parse_safetensors.
//
// A SafetensorsError is the expected outcome for malformed input; any other exception escapes, so
// libFuzzer reports it, as it does ASan/UBSan findings. When the input parses, properties are checked
// and a violation aborts:
//   - every tensor holds numel(shape) × dtype_size bytes, and all of them fit in the input;
//   - no tensor is called "__metadata__";
//   - serialize_safetensors of the result succeeds, parses again to an equal StateDict (names,
//     dtypes, shapes, bytes, metadata), and serialising that gives the same bytes (the writer's
//     output is canonical).
//
// A custom mutator helps the fuzzer past the 8-byte length prefix: after the usual mutation it
// sometimes rewrites the prefix so that the header ends at a '}' of the input (the bytes after it
// become the buffer), which random byte edits rarely achieve while the header keeps changing size.
#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" std::size_t LLVMFuzzerMutate(std::uint8_t* data, std::size_t size, std::size_t max_size);

extern "C" std::size_t LLVMFuzzerCustomMutator(std::uint8_t* data, std::size_t size, std::size_t max_size,
                                               unsigned int seed) {
  size = LLVMFuzzerMutate(data, size, max_size);
  if (size < 9 || seed % 3 != 0) return size;
  // Candidate header ends: positions just after a '}' in data[8..size).
  std::vector<std::size_t> ends;
  for (std::size_t i = 8; i < size; ++i) {
    if (data[i] == '}') ends.push_back(i + 1 - 8);
  }
  if (ends.empty()) return size;
  const std::size_t pick = (seed / 3) % ends.size();
  // Prefer the last '}' (the whole JSON object) half of the time.
  std::uint64_t n = ((seed / 3) % 2 == 0) ? ends.back() : ends[pick];
  for (int i = 0; i < 8; ++i) data[i] = static_cast<std::uint8_t>(n >> (8 * i));
  return size;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  c2f::StateDict sd;
  try {
    sd = c2f::parse_safetensors(data, size);
  } catch (const c2f::SafetensorsError&) {
    return 0;  // malformed input, rejected as it should be
  }

  // The input was: 8-byte length, header, then exactly the tensors' bytes.
  std::uint64_t total = 0;
  for (const auto& [name, t] : sd) {
    C2F_FUZZ_CHECK(name != "__metadata__", "a tensor is called __metadata__");
    std::uint64_t expected = 0;
    C2F_FUZZ_CHECK(c2f_fuzz::expected_nbytes(t, expected),
                   "tensor " + c2f::detail::quoted(name) + " has a shape whose byte count overflows");
    C2F_FUZZ_CHECK(t.bytes().size() == expected, "tensor " + c2f::detail::quoted(name) + " holds " +
                                                     std::to_string(t.bytes().size()) +
                                                     " bytes, numel x dtype_size = " + std::to_string(expected));
    total += t.bytes().size();
    C2F_FUZZ_CHECK(total <= size, "the tensors hold more bytes than the input");
  }
  C2F_FUZZ_CHECK(size >= 8 + total, "the tensors and the length prefix exceed the input");
  for (const auto& [key, value] : sd.metadata()) {
    C2F_FUZZ_CHECK(c2f::detail::is_utf8(key) && c2f::detail::is_utf8(value), "metadata not UTF-8");
  }

  // Everything the reader accepts, the writer can encode, and the encoding reads back the same.
  std::vector<std::uint8_t> encoded;
  try {
    encoded = c2f::serialize_safetensors(sd);
  } catch (const c2f::SafetensorsError& e) {
    C2F_FUZZ_CHECK(false, std::string("cannot re-encode a parsed file: ") + e.what());
  }
  C2F_FUZZ_CHECK(encoded.size() >= 8, "the encoding lacks the length prefix");
  const std::uint64_t n = c2f::detail::read_u64_le(encoded.data());
  C2F_FUZZ_CHECK(n % 8 == 0, "the writer's header is not padded to a multiple of 8 bytes");
  C2F_FUZZ_CHECK(n <= encoded.size() - 8 && encoded.size() - 8 - n == total,
                 "the writer's buffer does not hold exactly the tensors' bytes");
  c2f_fuzz::check_round_trip(sd, encoded, "parse(serialize(parse(input))) vs parse(input)");
  return 0;
}
