// qkv::models::detail::WeightTable (weight_table.hpp): the shape and dtype checks of every weight.
#include "models/weight_table.hpp"

#include "qkv/error.hpp"
#include "qkv/tensor.hpp"

namespace qkv::models::detail {

namespace {
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + (shape.size() == 1 ? ",)" : ")");
}
}  // namespace

const WeightView& WeightTable::expect(const std::string& name, const std::vector<int64_t>& shape) const {
  const WeightView* view = source_.find(name);
  if (view == nullptr)
    throw Error(model_ + ": missing weight '" + name + "' (" + source_.describe(name) +
                "): the config needs it with shape " + shape_text(shape));
  if (view->shape != shape)
    throw Error(model_ + ": weight '" + name + "' (" + source_.describe(name) + ") is " + shape_text(view->shape) +
                " but the config needs " + shape_text(shape));
  if (view->dtype != DType::F32 && view->dtype != DType::BF16 && view->dtype != DType::F16)
    throw Error(model_ + ": weight '" + name + "' (" + source_.describe(name) + ") has an unreadable dtype");
  if (view->data == nullptr)
    throw Error(model_ + ": weight '" + name + "' (" + source_.describe(name) + ") has no data");
  return *view;
}

StoredMatrix WeightTable::matrix(const std::string& name, int64_t rows, int64_t cols, Layout layout) const {
  const WeightView& view = expect(name, {rows, cols});
  const bool out_in = layout == Layout::OutIn;
  return StoredMatrix{.data = view.data,
                      .dtype = view.dtype,
                      .out = out_in ? rows : cols,
                      .in = out_in ? cols : rows,
                      .layout = layout};
}

std::vector<float> WeightTable::vector(const std::string& name, int64_t n) const {
  const WeightView& view = expect(name, {n});
  std::vector<float> out(static_cast<size_t>(n));
  convert(view.data, view.dtype, out.data(), DType::F32, out.size());
  return out;
}

}  // namespace qkv::models::detail
