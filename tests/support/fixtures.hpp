// Access to the PyTorch reference fixtures under tests/data (written by tests/reference/generate.py).
#pragma once

#include "c2f/io/safetensors.hpp"
#include "c2f/mask.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace c2f_test {

inline std::string data_path(const std::string& relative) { return std::string(C2F_TEST_DATA_DIR) + "/" + relative; }

/// Cases listed in tests/data/<family>/manifest.json.
inline std::vector<nlohmann::json> manifest_cases(const std::string& family) {
  std::ifstream in(data_path(family + "/manifest.json"));
  if (!in) throw std::runtime_error("cannot open " + data_path(family + "/manifest.json"));
  const nlohmann::json manifest = nlohmann::json::parse(in);
  return manifest.at("cases").get<std::vector<nlohmann::json>>();
}

/// One fixture file — a case of a family in one precision: the parameter of the fixture TEST_Ps, so
/// that every case is its own gtest entry, named after it, and can run alone.
struct FixtureParam {
  nlohmann::json meta;  ///< the case's manifest entry
  std::string dtype;    ///< "f32" or "f64"
  std::string name() const { return meta.at("name").get<std::string>() + "_" + dtype; }
  bool is_f32() const { return dtype == "f32"; }
  /// "<case> (<dtype>): <description>", for SCOPED_TRACE.
  std::string trace() const { return name() + ": " + meta.value("description", std::string()); }
};

/// Every case of `family` in both precisions (no entries when the manifest cannot be read: the
/// families' coverage tests fail then).
inline std::vector<FixtureParam> fixture_params(const std::string& family) {
  std::vector<FixtureParam> out;
  try {
    for (const nlohmann::json& c : manifest_cases(family)) {
      for (const char* dtype : {"f32", "f64"}) out.push_back({c, dtype});
    }
  } catch (const std::exception&) {
    out.clear();
  }
  return out;
}

/// gtest's name for a fixture parameter: the case name and the precision.
inline std::string fixture_param_name(const ::testing::TestParamInfo<FixtureParam>& info) { return info.param.name(); }

/// One gtest entry per fixture file of `family`: Fixtures/<Suite>.<Test>/<case>_<f32|f64>, each running
/// check<float> or check<double> on the case's manifest entry.
#define C2F_FIXTURE_TEST(Suite, Test, family, check)                                               \
  class Suite : public ::testing::TestWithParam<c2f_test::FixtureParam> {};                        \
  TEST_P(Suite, Test) {                                                                            \
    const c2f_test::FixtureParam& p = GetParam();                                                  \
    SCOPED_TRACE(p.trace());                                                                       \
    if (p.is_f32()) {                                                                              \
      check<float>(p.meta);                                                                        \
    } else {                                                                                       \
      check<double>(p.meta);                                                                       \
    }                                                                                              \
  }                                                                                                \
  INSTANTIATE_TEST_SUITE_P(Fixtures, Suite, ::testing::ValuesIn(c2f_test::fixture_params(family)), \
                           c2f_test::fixture_param_name)

inline c2f::Index meta_index(const c2f::StateDict& sd, const std::string& key) {
  return static_cast<c2f::Index>(std::stoll(sd.metadata().at(key)));
}

template <class Scalar>
c2f::Tensor3<Scalar> tensor3(const c2f::StateDict& sd, const std::string& name) {
  const c2f::TensorData& t = sd.at(name);
  if (t.shape().size() != 3) throw std::runtime_error(name + " is not 3-D");
  c2f::Tensor3<Scalar> out(t.shape()[0], t.shape()[1], t.shape()[2]);
  t.copy_to(out.data());
  return out;
}

/// Any-rank tensor as a flat vector plus its shape.
template <class Scalar>
std::vector<Scalar> values(const c2f::StateDict& sd, const std::string& name) {
  return sd.at(name).to_vector<Scalar>();
}

/// An I64 tensor's values.
inline std::vector<std::int64_t> int64_values(const c2f::StateDict& sd, const std::string& name) {
  const c2f::TensorData& t = sd.at(name);
  if (t.dtype() != c2f::DType::I64) throw std::runtime_error(name + " is not I64");
  std::vector<std::int64_t> out(static_cast<std::size_t>(t.numel()));
  if (!out.empty()) std::memcpy(out.data(), t.bytes().data(), t.bytes().size());
  return out;
}

}  // namespace c2f_test
