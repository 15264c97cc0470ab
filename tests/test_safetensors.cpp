#include "support/eigen_assert_throws.hpp"  // first: makes eigen_assert throw

#include "c2f/io/safetensors.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using Bytes = std::vector<std::uint8_t>;
using c2f::DType;
using c2f::SafetensorsError;
using c2f::StateDict;
using c2f::TensorData;

static_assert(std::is_base_of<std::invalid_argument, SafetensorsError>::value,
              "SafetensorsError must be a std::invalid_argument");

void append_u64(Bytes& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

/// 8-byte length of `header` (or `n_override`), the header text, then `buffer`.
Bytes make_file(const std::string& header, const Bytes& buffer = {},
                std::optional<std::uint64_t> n_override = std::nullopt) {
  Bytes out;
  append_u64(out, n_override ? *n_override : header.size());
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), buffer.begin(), buffer.end());
  return out;
}

Bytes zeros(std::size_t n) { return Bytes(n, 0); }

template <class T>
Bytes bytes_of(std::initializer_list<T> values) {
  Bytes out(values.size() * sizeof(T));
  std::size_t i = 0;
  for (T v : values) std::memcpy(out.data() + sizeof(T) * i++, &v, sizeof(T));
  return out;
}

StateDict parse(const Bytes& file) { return c2f::parse_safetensors(file.data(), file.size()); }

/// The message of the SafetensorsError that parsing `file` throws; records a failure when it throws
/// nothing or something else.
std::string parse_error(const Bytes& file) {
  try {
    parse(file);
  } catch (const SafetensorsError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected SafetensorsError, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected SafetensorsError, but the file parsed";
  return "";
}

/// Expects `file` to be rejected with a message that contains every one of `facts`.
void expect_rejected(const Bytes& file, std::initializer_list<std::string> facts) {
  EXPECT_THROW(parse(file), SafetensorsError);
  const std::string msg = parse_error(file);
  EXPECT_EQ(msg.rfind("c2f: safetensors: ", 0), 0u) << msg;
  for (const std::string& fact : facts) {
    EXPECT_NE(msg.find(fact), std::string::npos) << "message lacks \"" << fact << "\": " << msg;
  }
}

void expect_rejected(const std::string& header, const Bytes& buffer, std::initializer_list<std::string> facts) {
  expect_rejected(make_file(header, buffer), facts);
}

/// A unique path in the temporary directory, removed when the object dies.
class TempPath {
 public:
  explicit TempPath(const std::string& stem)
      : path_(std::filesystem::temp_directory_path() /
              ("c2f_test_safetensors_" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()) +
               "_" + stem + ".safetensors")) {
    std::filesystem::remove(path_);
  }
  ~TempPath() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  TempPath(const TempPath&) = delete;
  TempPath& operator=(const TempPath&) = delete;
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

/// A state dict with every kind of tensor the round trip must preserve.
StateDict sample_state_dict() {
  StateDict sd;
  const float f32[] = {1.5f, -2.25f, 3.0e-8f, 1.0e30f, -0.0f, 7.0f};
  sd.set("layer.weight", TensorData::from_values(f32, {2, 3}));
  const double f64[] = {0.1, -1.0e300, 4.9406564584124654e-324};
  sd.set("layer.bias", TensorData::from_values(f64, {3}));
  sd.set("half", TensorData(DType::F16, {2, 2}, bytes_of<std::uint16_t>({0x3C00, 0xC000, 0x3555, 0x0001})));
  sd.set("brain", TensorData(DType::BF16, {4}, bytes_of<std::uint16_t>({0x3F80, 0x3EAB, 0x7F80, 0x8001})));
  sd.set("index", TensorData(DType::I64, {2}, bytes_of<std::int64_t>({-1, std::numeric_limits<std::int64_t>::max()})));
  sd.set("mask", TensorData(DType::BOOL, {3}, Bytes{1, 0, 1}));
  const float scalar = 42.5f;
  sd.set("scale", TensorData::from_values(&scalar, {}));
  sd.set("empty", TensorData(DType::F32, {2, 0}, Bytes{}));
  sd.metadata()["format"] = "pt";
  sd.metadata()["note"] = "caf\xc3\xa9 \"quoted\"\n";
  return sd;
}

void expect_same(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.contains(name)) << name;
    const TensorData& u = b.at(name);
    EXPECT_EQ(t.dtype(), u.dtype()) << name;
    EXPECT_EQ(t.shape(), u.shape()) << name;
    EXPECT_EQ(t.bytes(), u.bytes()) << name;
  }
  EXPECT_EQ(a.metadata(), b.metadata());
}

std::string header_text(const Bytes& file) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | file.at(static_cast<std::size_t>(i));
  return std::string(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(n));
}

const char* kF32Entry = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

// ---------------------------------------------------------------------------------------------
// Round trips and the writer's layout.

TEST(Safetensors, RoundTripInMemoryPreservesDtypeShapeBytesAndMetadata) {
  const StateDict sd = sample_state_dict();
  const StateDict back = parse(c2f::serialize_safetensors(sd));
  expect_same(sd, back);
  EXPECT_EQ(back.at("scale").shape(), std::vector<std::int64_t>{});
  EXPECT_EQ(back.at("scale").to_vector<float>(), std::vector<float>{42.5f});
  EXPECT_EQ(back.at("empty").numel(), 0);
  EXPECT_EQ(back.at("layer.bias").to_vector<double>()[2], 4.9406564584124654e-324);
  EXPECT_EQ(back.metadata().at("note"), "caf\xc3\xa9 \"quoted\"\n");
}

TEST(Safetensors, RoundTripThroughFile) {
  const StateDict sd = sample_state_dict();
  TempPath path("round_trip");
  c2f::save_safetensors(path.str(), sd);
  const StateDict back = c2f::load_safetensors(path.str());
  expect_same(sd, back);

  // The file holds exactly the in-memory encoding.
  std::ifstream in(path.str(), std::ios::binary);
  const Bytes on_disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(on_disk, c2f::serialize_safetensors(sd));
}

TEST(Safetensors, WriterLaysOutTensorsInNameOrderWithContiguousOffsetsAndPaddedHeader) {
  const Bytes file = c2f::serialize_safetensors(sample_state_dict());
  const std::string header = header_text(file);
  EXPECT_EQ(header.size() % 8, 0u);
  const nlohmann::json j = nlohmann::json::parse(header);
  ASSERT_TRUE(j.contains("__metadata__"));
  EXPECT_EQ(j["__metadata__"]["format"], "pt");

  // Name order: std::map iteration order; offsets follow it contiguously from 0.
  const std::vector<std::string> names = {"brain",      "empty",        "half", "index",
                                          "layer.bias", "layer.weight", "mask", "scale"};
  std::uint64_t offset = 0;
  for (const std::string& name : names) {
    ASSERT_TRUE(j.contains(name)) << name;
    const nlohmann::json& offsets = j[name]["data_offsets"];
    EXPECT_EQ(offsets[0].get<std::uint64_t>(), offset) << name;
    offset = offsets[1].get<std::uint64_t>();
    for (const nlohmann::json& d : j[name]["shape"]) EXPECT_TRUE(d.is_number_integer()) << name;
  }
  EXPECT_EQ(8 + header.size() + offset, file.size());
  EXPECT_EQ(j["half"]["dtype"], "F16");
  EXPECT_EQ(j["empty"]["shape"], nlohmann::json::parse("[2, 0]"));
  EXPECT_EQ(j["scale"]["shape"], nlohmann::json::array());
}

TEST(Safetensors, WriterMatchesReferenceImplementationBytes) {
  // Expected bytes from the reference Rust implementation's own tests (test_serialization).
  StateDict sd;
  const float values[] = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f};
  sd.set("attn.0", TensorData::from_values(values, {1, 2, 3}));
  const Bytes expected = {
      64,  0,  0,   0,  0,   0,  0,   0,   123, 34,  97,  116, 116, 110, 46,  48, 34, 58, 123, 34, 100, 116, 121, 112,
      101, 34, 58,  34, 70,  51, 50,  34,  44,  34,  115, 104, 97,  112, 101, 34, 58, 91, 49,  44, 50,  44,  51,  93,
      44,  34, 100, 97, 116, 97, 95,  111, 102, 102, 115, 101, 116, 115, 34,  58, 91, 48, 44,  50, 52,  93,  125, 125,
      0,   0,  0,   0,  0,   0,  128, 63,  0,   0,   0,   64,  0,   0,   64,  64, 0,  0,  128, 64, 0,   0,   160, 64};
  EXPECT_EQ(c2f::serialize_safetensors(sd), expected);

  // test_empty: no tensors, then no tensors but metadata.
  StateDict empty;
  EXPECT_EQ(c2f::serialize_safetensors(empty), (Bytes{8, 0, 0, 0, 0, 0, 0, 0, '{', '}', 32, 32, 32, 32, 32, 32}));
  empty.metadata()["framework"] = "pt";
  EXPECT_EQ(c2f::serialize_safetensors(empty),
            make_file(std::string(R"({"__metadata__":{"framework":"pt"}})") + "     "));
}

TEST(Safetensors, WriterOmitsEmptyMetadata) {
  StateDict sd;
  const float v = 1.0f;
  sd.set("x", TensorData::from_values(&v, {1}));
  EXPECT_EQ(header_text(c2f::serialize_safetensors(sd)).find("__metadata__"), std::string::npos);
}

TEST(Safetensors, WriterPadsHeaderWithSpacesToMultipleOf8) {
  for (std::size_t len = 1; len <= 16; ++len) {
    StateDict sd;
    const float v = 1.0f;
    sd.set(std::string(len, 'a'), TensorData::from_values(&v, {1}));
    const std::string header = header_text(c2f::serialize_safetensors(sd));
    EXPECT_EQ(header.size() % 8, 0u) << len;
    const std::size_t close = header.rfind('}');
    EXPECT_LT(header.size() - close - 1, 8u);
    EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos) << len;
    EXPECT_EQ(parse(c2f::serialize_safetensors(sd)).size(), 1u);
  }
}

TEST(Safetensors, WriterRejectsTensorsItCannotEncode) {
  StateDict reserved;
  reserved.set("__metadata__", TensorData(DType::U8, {1}, Bytes{7}));
  EXPECT_THROW(c2f::serialize_safetensors(reserved), SafetensorsError);

  StateDict bad_name;
  bad_name.set("w\xff", TensorData(DType::U8, {1}, Bytes{7}));
  EXPECT_THROW(c2f::serialize_safetensors(bad_name), SafetensorsError);

  StateDict bad_meta;
  bad_meta.metadata()["k"] = "\xc0\x80";
  EXPECT_THROW(c2f::serialize_safetensors(bad_meta), SafetensorsError);

  // TensorData refuses bytes that do not match its shape, so the writer never sees such a tensor.
  EXPECT_THROW(TensorData(DType::F32, {2}, Bytes{1, 2, 3}), std::invalid_argument);
  StateDict empty_default;
  empty_default.set("w", TensorData());
  const Bytes encoded = c2f::serialize_safetensors(empty_default);
  const StateDict back = c2f::parse_safetensors(encoded.data(), encoded.size());
  EXPECT_EQ(back.at("w").shape(), (std::vector<std::int64_t>{0}));

  TempPath path("not_written");
  EXPECT_THROW(c2f::save_safetensors(path.str(), reserved), SafetensorsError);
  EXPECT_FALSE(std::filesystem::exists(path.str()));
}

// ---------------------------------------------------------------------------------------------
// Half-precision weights load as their exact values.

TEST(Safetensors, F16WeightsLoadAsExactValues) {
  const std::vector<std::uint16_t> bits = {0x3C00, 0xC000, 0x3555, 0x0001, 0x03FF, 0x7BFF, 0x7C00, 0xFC00, 0x8000};
  const std::vector<double> expected = {1.0,
                                        -2.0,
                                        0.333251953125,
                                        std::ldexp(1.0, -24),     // smallest subnormal
                                        std::ldexp(1023.0, -24),  // largest subnormal
                                        65504.0,
                                        std::numeric_limits<double>::infinity(),
                                        -std::numeric_limits<double>::infinity(),
                                        -0.0};
  Bytes buffer(bits.size() * 2);
  std::memcpy(buffer.data(), bits.data(), buffer.size());
  const std::string header =
      R"({"h":{"dtype":"F16","shape":[9],"data_offsets":[0,)" + std::to_string(buffer.size()) + "]}}";
  const StateDict sd = parse(make_file(header, buffer));
  const std::vector<float> as_float = sd.at("h").to_vector<float>();
  const std::vector<double> as_double = sd.at("h").to_vector<double>();
  ASSERT_EQ(as_float.size(), expected.size());
  ASSERT_EQ(as_double.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(as_float[i], static_cast<float>(expected[i])) << "bits 0x" << std::hex << bits[i];
    EXPECT_EQ(as_double[i], expected[i]) << "bits 0x" << std::hex << bits[i];
  }
  EXPECT_TRUE(std::signbit(as_double[8]));

  const Bytes nan_bits = bytes_of<std::uint16_t>({0x7E00});
  const StateDict nan = parse(make_file(R"({"n":{"dtype":"F16","shape":[],"data_offsets":[0,2]}})", nan_bits));
  EXPECT_TRUE(std::isnan(nan.at("n").to_vector<double>()[0]));
}

TEST(Safetensors, BF16WeightsLoadAsExactValues) {
  const std::vector<std::uint16_t> bits = {0x3F80, 0x3EAB, 0xC000, 0x0001, 0x7F7F, 0x7F80, 0xFF80, 0x8000};
  const std::vector<double> expected = {1.0,
                                        0.333984375,
                                        -2.0,
                                        std::ldexp(1.0, -133),   // smallest subnormal
                                        std::ldexp(255.0, 120),  // largest finite
                                        std::numeric_limits<double>::infinity(),
                                        -std::numeric_limits<double>::infinity(),
                                        -0.0};
  Bytes buffer(bits.size() * 2);
  std::memcpy(buffer.data(), bits.data(), buffer.size());
  const std::string header =
      R"({"b":{"dtype":"BF16","shape":[2,4],"data_offsets":[0,)" + std::to_string(buffer.size()) + "]}}";
  const StateDict sd = parse(make_file(header, buffer));
  const std::vector<float> as_float = sd.at("b").to_vector<float>();
  const std::vector<double> as_double = sd.at("b").to_vector<double>();
  ASSERT_EQ(as_double.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(as_float[i], static_cast<float>(expected[i])) << "bits 0x" << std::hex << bits[i];
    EXPECT_EQ(as_double[i], expected[i]) << "bits 0x" << std::hex << bits[i];
  }
  EXPECT_TRUE(std::signbit(as_double[7]));
}

// ---------------------------------------------------------------------------------------------
// Inputs that must load.

TEST(Safetensors, LoadsEmptyHeaderWithoutBuffer) {
  const StateDict sd = parse(make_file("{}"));
  EXPECT_TRUE(sd.empty());
  EXPECT_TRUE(sd.metadata().empty());
}

TEST(Safetensors, LoadsHeaderPaddedWithSpaces) {
  const StateDict sd = parse(make_file(std::string(kF32Entry) + "       ", bytes_of<float>({1.0f, 2.0f})));
  EXPECT_EQ(sd.at("w").to_vector<float>(), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_TRUE(parse(make_file("{}" + std::string(14, ' '))).empty());
}

TEST(Safetensors, LoadsZeroSizeShape) {
  const StateDict sd = parse(make_file(R"({"z":{"dtype":"F32","shape":[2,0],"data_offsets":[0,0]}})"));
  EXPECT_EQ(sd.at("z").shape(), (std::vector<std::int64_t>{2, 0}));
  EXPECT_EQ(sd.at("z").numel(), 0);
  EXPECT_TRUE(sd.at("z").bytes().empty());

  // A zero dimension makes huge neighbours harmless: the product is genuinely 0.
  const StateDict big = parse(
      make_file(R"({"z":{"dtype":"F64","shape":[0,4611686018427387904,4611686018427387904],"data_offsets":[0,0]}})"));
  EXPECT_EQ(big.at("z").numel(), 0);
}

TEST(Safetensors, LoadsScalarShape) {
  const StateDict sd =
      parse(make_file(R"({"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}})", bytes_of<double>({-3.75})));
  EXPECT_TRUE(sd.at("s").shape().empty());
  EXPECT_EQ(sd.at("s").to_vector<double>(), std::vector<double>{-3.75});
}

TEST(Safetensors, LoadsMetadata) {
  const StateDict sd = parse(make_file(R"({"__metadata__":{"format":"pt","a":""},)" + std::string(kF32Entry + 1),
                                       bytes_of<float>({1.0f, 2.0f})));
  EXPECT_EQ(sd.size(), 1u);
  EXPECT_FALSE(sd.contains("__metadata__"));
  EXPECT_EQ(sd.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"a", ""}}));
}

TEST(Safetensors, LoadsEveryDtypeAsRawBytes) {
  const std::vector<DType> dtypes = {DType::BOOL, DType::U8,  DType::I8,  DType::F8_E5M2, DType::F8_E4M3,
                                     DType::I16,  DType::U16, DType::F16, DType::BF16,    DType::I32,
                                     DType::U32,  DType::F32, DType::I64, DType::U64,     DType::F64};
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  Bytes buffer;
  for (DType t : dtypes) {
    const std::size_t n = 3 * c2f::dtype_size(t);
    header[std::string("t_") + c2f::dtype_name(t)] = {
        {"dtype", c2f::dtype_name(t)},
        {"shape", nlohmann::ordered_json::array({3})},
        {"data_offsets", nlohmann::ordered_json::array({buffer.size(), buffer.size() + n})}};
    for (std::size_t i = 0; i < n; ++i) buffer.push_back(static_cast<std::uint8_t>(buffer.size() * 7 + 1));
  }
  const StateDict sd = parse(make_file(header.dump(), buffer));
  ASSERT_EQ(sd.size(), dtypes.size());
  std::size_t offset = 0;
  for (DType t : dtypes) {
    const TensorData& td = sd.at(std::string("t_") + c2f::dtype_name(t));
    const std::size_t n = 3 * c2f::dtype_size(t);
    EXPECT_EQ(td.dtype(), t);
    EXPECT_EQ(td.numel(), 3);
    EXPECT_EQ(td.bytes(), Bytes(buffer.begin() + static_cast<std::ptrdiff_t>(offset),
                                buffer.begin() + static_cast<std::ptrdiff_t>(offset + n)));
    offset += n;
  }
  const std::int16_t i16 = -2;
  Bytes i16_bytes(2);
  std::memcpy(i16_bytes.data(), &i16, 2);
  const StateDict ints = parse(make_file(R"({"i":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}})", i16_bytes));
  EXPECT_EQ(ints.at("i").bytes(), i16_bytes);
  EXPECT_THROW(ints.at("i").to_vector<float>(),
               std::invalid_argument);  // conversion is F16/BF16/F32/F64 only
}

TEST(Safetensors, LoadsTensorsWhoseOffsetOrderDiffersFromNameOrder) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                             R"("c":{"dtype":"U8","shape":[0],"data_offsets":[8,8]}})";
  const StateDict sd = parse(make_file(header, bytes_of<float>({10.0f, 20.0f})));
  EXPECT_EQ(sd.at("a").to_vector<float>(), std::vector<float>{20.0f});
  EXPECT_EQ(sd.at("b").to_vector<float>(), std::vector<float>{10.0f});
}

TEST(Safetensors, IgnoresUnknownEntryFieldsLikeTheReference) {
  const StateDict sd = parse(make_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":[1]}})", Bytes{9}));
  EXPECT_EQ(sd.at("w").bytes(), Bytes{9});
}

// ---------------------------------------------------------------------------------------------
// One test per validation rule.

TEST(SafetensorsRejects, Rule1HeaderTooSmall) {
  EXPECT_THROW(c2f::parse_safetensors(nullptr, 0), SafetensorsError);
  for (std::size_t size = 0; size < 8; ++size) expect_rejected(zeros(size), {"header too small", std::to_string(size)});
}

TEST(SafetensorsRejects, Rule2HeaderTooLarge) {
  expect_rejected(make_file("{}", {}, 100'000'001), {"header too large", "100000001"});
  expect_rejected(make_file("{}", {}, std::numeric_limits<std::uint64_t>::max()),
                  {"header too large", "18446744073709551615"});
  // Exactly at the limit is allowed by rule 2, so rule 3 reports it.
  expect_rejected(make_file("{}", {}, 100'000'000), {"invalid header length", "100000000"});
}

TEST(SafetensorsRejects, Rule3HeaderPastEndOfData) {
  expect_rejected(make_file("{}", {}, 3), {"invalid header length", "3", "10 bytes"});
  Bytes file = make_file(kF32Entry);
  file.resize(file.size() - 1);  // truncated inside the header
  expect_rejected(file, {"invalid header length"});
}

TEST(SafetensorsRejects, Rule3HeaderLengthPlus8OverflowingU64) {
  // 8 + N wraps to 0..7 for these N: a reader that checks "8 + N <= size" would accept them and read the
  // header past the end. They are rejected by the size bound before any such sum is formed.
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  for (const std::uint64_t n : {kMax, kMax - 1, kMax - 7, kMax - 8}) {
    SCOPED_TRACE(n);
    expect_rejected(make_file("{}", {}, n), {"header too large", std::to_string(n)});
    expect_rejected(make_file("{}", zeros(64), n), {"header too large", std::to_string(n)});
  }
  // Just over the bound and with a large file it is still the bound that rejects it.
  expect_rejected(make_file("{}", zeros(1024), kMax - 1023), {"header too large"});
}

TEST(SafetensorsRejects, Rule4HeaderNotUtf8) {
  expect_rejected(make_file("{\"w\xff\":{}}"), {"UTF-8", "0xff", "offset 3"});  // in a key
  expect_rejected(make_file(R"({"__metadata__":{"k":")"
                            "\xc0\x80"
                            R"("}})"),
                  {"UTF-8", "0xc0"});                                      // overlong
  expect_rejected(make_file("{\"\xed\xa0\x80\":{}}"), {"UTF-8", "0xed"});  // surrogate
  expect_rejected(make_file("{\"\xf4\x90\x80\x80\":{}}"), {"UTF-8"});      // > U+10FFFF
  expect_rejected(make_file("{}   \xe2\x82"), {"UTF-8", "offset 5"});      // truncated, in the padding

  // nlohmann's own parser (behind our check) rejects the same bytes too.
  nlohmann::json parsed;
  EXPECT_THROW(parsed = nlohmann::json::parse(std::string("{\"w\xff\":1}")), nlohmann::json::parse_error);
  // Well-formed multi-byte names load.
  const std::string name = "\xe2\x82\xac\xf0\x9f\x98\x80";  // €😀
  const StateDict sd =
      parse(make_file("{\"" + name + R"(":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", Bytes{5}));
  EXPECT_TRUE(sd.contains(name));
}

TEST(SafetensorsRejects, Rule5NotJson) {
  expect_rejected(make_file("{"), {"not valid JSON"});
  expect_rejected(make_file(""), {"not valid JSON"});
  expect_rejected(make_file("{} x"), {"not valid JSON"});
  expect_rejected(make_file("{/*c*/}"), {"not valid JSON"});
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],}})"), {"not valid JSON"});
}

TEST(SafetensorsRejects, Rule5HeaderNotAnObject) {
  expect_rejected(make_file("[]"), {"must be an object", "array"});
  expect_rejected(make_file("\"x\""), {"must be an object", "string"});
  expect_rejected(make_file("null"), {"must be an object", "null"});
}

TEST(SafetensorsRejects, Rule5EntryNotAnObject) {
  expect_rejected(make_file(R"({"w": 1})"), {"\"w\"", "must be an object", "number"});
  expect_rejected(make_file(R"({"w": [0, 4]})"), {"\"w\"", "must be an object", "array"});
}

TEST(SafetensorsRejects, Rule5MissingOrMistypedDtype) {
  expect_rejected(make_file(R"({"w":{"shape":[1],"data_offsets":[0,4]}})"), {"\"w\"", "no \"dtype\""});
  expect_rejected(make_file(R"({"w":{"dtype":32,"shape":[1],"data_offsets":[0,4]}})"),
                  {"\"w\"", "\"dtype\" must be a string", "32"});
}

TEST(SafetensorsRejects, Rule5MissingOrMistypedShape) {
  const char* cases[][2] = {
      {R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", "no \"shape\""},
      {R"({"w":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", "\"shape\" must be an array"},
      {R"({"w":{"dtype":"F32","shape":{"0":1},"data_offsets":[0,4]}})", "\"shape\" must be an array"},
      {R"({"w":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})", "1.0"},
      {R"({"w":{"dtype":"F32","shape":[1e0],"data_offsets":[0,4]}})", "non-negative integers"},
      {R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "-1"},
      {R"({"w":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}})", "true"},
      {R"({"w":{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}})", "\"1\""},
      {R"({"w":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})", "[[1]]"},
      {R"({"w":{"dtype":"F32","shape":[null],"data_offsets":[0,4]}})", "null"},
      {R"({"w":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,4]}})", "9223372036854775808 in"},
      {R"({"w":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,4]}})", "non-negative integers"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c[0]);
    expect_rejected(make_file(c[0], zeros(4)), {"tensor \"w\"", c[1]});
  }
}

TEST(SafetensorsRejects, Rule5MissingOrMistypedDataOffsets) {
  const char* cases[][2] = {
      {R"({"w":{"dtype":"F32","shape":[1]}})", "no \"data_offsets\""},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "[0]"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", "[0,4,8]"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[]}})", "exactly two"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", "[-4,0]"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})", "[0,4.0]"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,"4"]}})", "non-negative integers"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":{"begin":0,"end":4}}})", "exactly two"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":"0,4"}})", "exactly two"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551616]}})", "exactly two"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c[0]);
    expect_rejected(make_file(c[0], zeros(4)), {"tensor \"w\"", "data_offsets", c[1]});
  }
}

TEST(SafetensorsRejects, Rule5TensorMissingDataOffsets) {
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[1]}})", zeros(4)), {"tensor \"w\"", "no \"data_offsets\""});
  // The second tensor lacks it; the first is fine.
  expect_rejected(make_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                            R"("b":{"dtype":"U8","shape":[1]}})",
                            zeros(2)),
                  {"tensor \"b\"", "no \"data_offsets\""});
  // A misspelt key does not count (unknown keys are ignored, like the reference does).
  expect_rejected(make_file(R"({"w":{"dtype":"U8","shape":[1],"data_offset":[0,1]}})", zeros(1)),
                  {"tensor \"w\"", "no \"data_offsets\""});
  // An empty tensor needs its offsets too.
  expect_rejected(make_file(R"({"z":{"dtype":"F32","shape":[0]}})"), {"tensor \"z\"", "no \"data_offsets\""});
}

TEST(SafetensorsRejects, Rule5DuplicateKeys) {
  // nlohmann keeps the last duplicate; the file is ambiguous, so it is rejected.
  expect_rejected(make_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                            R"("w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
                            zeros(2)),
                  {"\"w\"", "duplicate"});
  expect_rejected(make_file(R"({"w":{"dtype":"F32","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", zeros(1)),
                  {"\"dtype\"", "repeats"});
  expect_rejected(make_file(R"({"__metadata__":{"k":"a","k":"b"}})"), {"\"k\"", "repeats"});
  // The same key in sibling objects is not a duplicate.
  EXPECT_EQ(parse(make_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                            R"("b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                            zeros(2)))
                .size(),
            2u);
}

TEST(SafetensorsRejects, Rule6UnknownDtype) {
  for (const char* dtype : {"F4", "F6_E2M3", "C64", "f32", "", "F32 "}) {
    SCOPED_TRACE(dtype);
    const std::string header =
        std::string(R"({"weight.q":{"dtype":")") + dtype + R"(","shape":[1],"data_offsets":[0,1]}})";
    expect_rejected(make_file(header, zeros(1)),
                    {"tensor \"weight.q\"", "unknown dtype", "\"" + std::string(dtype) + "\""});
  }
}

TEST(SafetensorsRejects, Rule7ShapeProductOverflow) {
  // The byte count wraps to a small non-zero value that the offsets and the buffer then match:
  // (2^62 + 1) × 4 = 2^64 + 4 ≡ 4.
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[4611686018427387905],"data_offsets":[0,4]}})", zeros(4)),
                  {"tensor \"w\"", "overflows", "[4611686018427387905]", "F32"});
  // The element count overflows: 3 × (2^63 − 1) ≡ 2^63 − 3.
  expect_rejected(make_file(R"({"w":{"dtype":"U8","shape":[3,9223372036854775807],"data_offsets":[0,0]}})"),
                  {"tensor \"w\"", "overflows", "[3, 9223372036854775807]", "U8"});
  // The element count fits, the byte count does not: (2^61 + 1) × 8.
  expect_rejected(make_file(R"({"w":{"dtype":"F64","shape":[2305843009213693953],"data_offsets":[0,8]}})", zeros(8)),
                  {"tensor \"w\"", "overflows", "F64"});
  // An overflow before a 0 dimension is an overflow (the product is formed left to right, as in the
  // reference implementation).
  expect_rejected(make_file(R"({"w":{"dtype":"U8","shape":[4294967297,4294967297,0],"data_offsets":[0,0]}})"),
                  {"tensor \"w\"", "overflows"});
}

TEST(SafetensorsRejects, Rule7ShapeProductWrappingToZero) {
  // 2^32 × 2^32 = 2^64 wraps to 0 in 64-bit arithmetic; offsets [0, 0] and no buffer would then look
  // like a consistent empty tensor. It must be rejected, not loaded as empty.
  expect_rejected(make_file(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"),
                  {"tensor \"w\"", "overflows", "[4294967296, 4294967296]", "U8"});
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"),
                  {"tensor \"w\"", "overflows", "[4294967296, 4294967296]", "F32"});
  expect_rejected(make_file(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296,1],"data_offsets":[0,0]}})"),
                  {"overflows"});
  expect_rejected(make_file(R"({"w":{"dtype":"U8","shape":[65536,65536,65536,65536],"data_offsets":[0,0]}})"),
                  {"overflows", "[65536, 65536, 65536, 65536]"});
  expect_rejected(make_file(R"({"w":{"dtype":"U8","shape":[4,4611686018427387904],"data_offsets":[0,0]}})"),
                  {"overflows", "[4, 4611686018427387904]"});
  // Only the byte count wraps to 0: 2^63 × 2 (F16), 2^62 × 4 (F32), 2^62 × 8 (F64).
  expect_rejected(make_file(R"({"w":{"dtype":"F16","shape":[4611686018427387904,2],"data_offsets":[0,0]}})"),
                  {"tensor \"w\"", "overflows", "F16"});
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})"),
                  {"tensor \"w\"", "overflows", "F32"});
  expect_rejected(make_file(R"({"w":{"dtype":"F64","shape":[2,2305843009213693952],"data_offsets":[0,0]}})"),
                  {"tensor \"w\"", "overflows", "F64"});
  // Next to a genuine empty tensor, the wrapping one is still the one reported.
  expect_rejected(make_file(R"({"e":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)"
                            R"("w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"),
                  {"tensor \"w\"", "overflows"});
}

TEST(SafetensorsRejects, Rule8OffsetsNotStartingAtZero) {
  expect_rejected(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", zeros(8),
                  {"tensor \"w\"", "[4, 8]", "first tensor must begin at byte 0"});
  // An empty tensor must sit at 0 too when it is the only one.
  expect_rejected(R"({"z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})", {},
                  {"tensor \"z\"", "[4, 4]", "begin at byte 0"});
  // Offsets near 2^64.
  expect_rejected(R"({"w":{"dtype":"U8","shape":[1],)"
                  R"("data_offsets":[18446744073709551615,18446744073709551615]}})",
                  zeros(1), {"tensor \"w\"", "18446744073709551615", "begin at byte 0"});
}

TEST(SafetensorsRejects, Rule8OffsetsWithGap) {
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                  zeros(12), {"tensor \"b\"", "[8, 12]", "byte 4", "tensor \"a\"", "gap"});
  // A gap before an empty tensor is a gap as well.
  expect_rejected(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                  R"("z":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})",
                  zeros(2), {"tensor \"z\"", "[2, 2]", "byte 1", "gap"});
}

TEST(SafetensorsRejects, Rule8OverlappingOffsets) {
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  zeros(8), {"tensor \"b\"", "[4, 8]", "byte 8", "overlap"});
  // Two non-empty tensors sharing their bytes.
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                  zeros(4), {"tensor \"b\"", "[0, 4]", "overlap"});
  // An empty tensor placed inside another one's bytes.
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                  zeros(8), {"tensor \"z\"", "[4, 4]", "overlap"});
}

TEST(SafetensorsRejects, Rule8OffsetsEndBeforeBegin) {
  expect_rejected(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", zeros(4),
                  {"tensor \"w\"", "[4, 0]", "end before they begin"});
  expect_rejected(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                  R"("b":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,0]}})",
                  zeros(1), {"tensor \"b\"", "[18446744073709551615, 0]", "end before they begin"});
  // end − begin would wrap to the tensor's byte count (1 − 2^64 + 3 ≡ 4).
  expect_rejected(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551613,1]}})", zeros(4),
                  {"tensor \"w\"", "end before they begin"});
}

TEST(SafetensorsRejects, Rule9SpanMustMatchShapeAndDtype) {
  expect_rejected(R"({"layer.w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", zeros(20),
                  {"tensor \"layer.w\"", "F32", "[2, 3]", "needs 24 bytes", "[0, 20]", "span 20"});
  expect_rejected(R"({"w":{"dtype":"BF16","shape":[],"data_offsets":[0,4]}})", zeros(4),
                  {"tensor \"w\"", "BF16", "[]", "needs 2 bytes"});
  expect_rejected(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[0,4]}})", zeros(4), {"needs 0 bytes"});
  // A span near 2^64 with a small shape.
  expect_rejected(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}})", zeros(4),
                  {"tensor \"w\"", "needs 4 bytes", "span 18446744073709551615"});
}

TEST(SafetensorsRejects, Rule10TrailingBytesAfterLastTensor) {
  Bytes trailing = bytes_of<float>({1.0f, 2.0f});
  trailing.push_back(0);
  expect_rejected(kF32Entry, trailing, {"cover 8 bytes", "holds 9", "trailing"});
  expect_rejected("{}", Bytes{0}, {"cover 0 bytes", "holds 1", "trailing"});
  // Only empty tensors, then a byte.
  expect_rejected(R"({"z":{"dtype":"F32","shape":[2,0],"data_offsets":[0,0]}})", Bytes{0},
                  {"cover 0 bytes", "holds 1", "trailing"});
  // Bytes after the last tensor in offset order (not name order).
  expect_rejected(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},)"
                  R"("b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                  zeros(10), {"cover 2 bytes", "holds 10", "trailing"});
}

TEST(SafetensorsRejects, Rule10BufferShorterThanTensors) {
  const Bytes data = bytes_of<float>({1.0f, 2.0f});
  expect_rejected(kF32Entry, Bytes(data.begin(), data.end() - 1), {"cover 8 bytes", "holds 7", "too short"});
  // A span as large as the shape allows, far beyond the data (the sum end + 8 + N would wrap).
  expect_rejected(R"({"w":{"dtype":"F64","shape":[2305843009213693951],"data_offsets":[0,18446744073709551608]}})",
                  zeros(8), {"cover 18446744073709551608 bytes", "too short"});
}

TEST(SafetensorsRejects, Rule11MetadataMustMapStringsToStrings) {
  expect_rejected(make_file(R"({"__metadata__":"pt"})"), {"__metadata__", "must be an object", "\"pt\""});
  expect_rejected(make_file(R"({"__metadata__":["a"]})"), {"__metadata__", "must be an object"});
  expect_rejected(make_file(R"({"__metadata__":null})"), {"__metadata__", "must be an object", "null"});
  expect_rejected(make_file(R"({"__metadata__":{"a":"b","n":1}})"), {"__metadata__", "\"n\"", "number"});
  expect_rejected(make_file(R"({"__metadata__":{"n":null}})"), {"__metadata__", "\"n\"", "null"});
  expect_rejected(make_file(R"({"__metadata__":{"o":{"x":"y"}}})"), {"__metadata__", "\"o\"", "object"});
}

TEST(SafetensorsRejects, DeeplyNestedJsonWithoutCrashing) {
  // The reference reader (serde_json) stops at 128 levels; so does this one, before building a DOM.
  const std::size_t depth = 1'000'000;
  const std::string nested = std::string(depth, '[') + std::string(depth, ']');
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":)" + nested + R"(,"data_offsets":[0,0]}})"),
                  {"deeper than 128"});
  expect_rejected(make_file(nested), {"deeper than 128"});
  std::string objects;
  for (std::size_t i = 0; i < depth; ++i) objects += "{\"a\":";
  expect_rejected(make_file(objects + "1" + std::string(depth, '}')), {"deeper than 128"});

  // 128 levels are fine for the JSON reader; the entry is then rejected for its shape.
  const std::string deep_shape = std::string(126, '[') + "1" + std::string(126, ']');
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":)" + deep_shape + R"(,"data_offsets":[0,4]}})", zeros(4)),
                  {"tensor \"w\"", "\"shape\" must be an array of non-negative integers", "[[[[[...]]]]]"});
  const std::string too_deep_shape = std::string(127, '[') + "1" + std::string(127, ']');
  expect_rejected(
      make_file(R"({"w":{"dtype":"F32","shape":)" + too_deep_shape + R"(,"data_offsets":[0,4]}})", zeros(4)),
      {"deeper than 128"});
}

TEST(SafetensorsRejects, LongNamesAreShortenedInMessages) {
  const std::string name(10'000, 'n');
  const std::string msg = parse_error(make_file("{\"" + name + R"(":{"dtype":"X","shape":[],"data_offsets":[0,0]}})"));
  EXPECT_NE(msg.find("unknown dtype"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 1000u);
}

// ---------------------------------------------------------------------------------------------
// The fuzzers' seed corpus and the crash inputs they found (tests/fuzz/).

std::filesystem::path fuzz_dir() {
  return (std::filesystem::path(C2F_TEST_DATA_DIR) / ".." / "fuzz").lexically_normal();
}

Bytes read_file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

/// Parses `file`: "ok" when it loads, "rejected" on SafetensorsError; any other exception is a failure.
std::string parse_outcome(const std::filesystem::path& path) {
  const Bytes file = read_file_bytes(path);
  try {
    const StateDict sd = parse(file);
    // What loads re-encodes to something that loads the same.
    expect_same(sd, parse(c2f::serialize_safetensors(sd)));
    return "ok";
  } catch (const SafetensorsError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("c2f: safetensors: ", 0), 0u) << msg;
    return "rejected";
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected success or SafetensorsError, got another exception: " << e.what();
  } catch (...) {
    ADD_FAILURE() << "expected success or SafetensorsError, got a non-std exception";
  }
  return "error";
}

std::vector<std::filesystem::path> files_under(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) out.push_back(entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(SafetensorsCorpus, EveryFileParsesOrThrowsSafetensorsError) {
  const std::filesystem::path parse_corpus = fuzz_dir() / "corpus" / "parse";
  const std::filesystem::path regressions = fuzz_dir() / "regressions";
  ASSERT_TRUE(std::filesystem::is_directory(parse_corpus)) << parse_corpus;
  ASSERT_TRUE(std::filesystem::is_directory(regressions)) << regressions;
  std::size_t count = 0;
  for (const auto& dir : {parse_corpus, regressions}) {
    for (const std::filesystem::path& path : files_under(dir)) {
      SCOPED_TRACE(path.string());
      const std::string outcome = parse_outcome(path);
      // The seed corpus says by its names what to expect.
      const std::string stem = path.filename().string();
      if (stem.rfind("ok_", 0) == 0) {
        EXPECT_EQ(outcome, "ok");
      } else if (stem.rfind("bad_", 0) == 0) {
        EXPECT_EQ(outcome, "rejected");
      } else {
        EXPECT_NE(outcome, "error");
      }
      ++count;
    }
  }
  EXPECT_GE(count, 10u) << "the seed corpus went missing";
}

// ---------------------------------------------------------------------------------------------
// Files.

TEST(Safetensors, LoadMissingFileThrowsRuntimeErrorNamingThePath) {
  const std::string path =
      (std::filesystem::temp_directory_path() / "c2f_no_such_dir" / "missing.safetensors").string();
  try {
    c2f::load_safetensors(path);
    FAIL() << "expected std::runtime_error";
  } catch (const SafetensorsError& e) {
    FAIL() << "a missing file is not a format error: " << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  const std::string dir = std::filesystem::temp_directory_path().string();
  EXPECT_THROW(c2f::load_safetensors(dir), std::runtime_error);
}

TEST(Safetensors, SaveToUnwritablePathThrowsRuntimeErrorNamingThePath) {
  const std::string path = (std::filesystem::temp_directory_path() / "c2f_no_such_dir" / "out.safetensors").string();
  try {
    c2f::save_safetensors(path, sample_state_dict());
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(Safetensors, LoadMalformedFileThrowsSafetensorsErrorNamingThePath) {
  TempPath path("malformed");
  {
    std::ofstream out(path.str(), std::ios::binary);
    out << "abc";
  }
  try {
    c2f::load_safetensors(path.str());
    FAIL() << "expected SafetensorsError";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("header too small"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path.str()), std::string::npos) << e.what();
  }
}

}  // namespace
