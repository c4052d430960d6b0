// The drawing and arithmetic behind `qkv viz`, `qkv memory` and `qkv scaling` (tools/qkv/plot.cpp,
// tools/qkv/numbers.cpp): heatmaps read back pixel by pixel, SVG cells counted, the memory
// figures against hand-computed values, the slope fit on data with a known exponent.
// The command lines themselves are run by tests/cli/cli_tools_check.cmake.
#include <cairo.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "numbers.hpp"
#include "plot.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::cli::plot::HeatmapFigure;
using qkv::cli::plot::HeatmapLayout;
using qkv::cli::plot::HeatmapPanel;

// A scratch file of this process (its pid in the name: two suites at once must not share one).
std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("qkv_test_cli_tools_" + std::to_string(::getpid()) + "_" + name)).string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// One head's causal weights for n random tokens, (n, n) row-major, from the library's reference.
std::vector<float> causal_weights(int64_t n, uint64_t seed) {
  qkv::AttentionOptions options;
  options.mask = qkv::Mask::causal();
  options.need_weights = true;
  options.backend = qkv::Backend::Reference;
  const auto q = qkv::Tensor::randn({n, 8}, seed), k = qkv::Tensor::randn({n, 8}, seed + 1),
             v = qkv::Tensor::randn({n, 8}, seed + 2);
  return qkv::scaled_dot_product_attention(q, k, v, options).weights.to_vector();
}

HeatmapFigure one_panel_figure(const std::vector<float>& weights, int64_t n, bool print_values) {
  HeatmapFigure figure;
  figure.title = "test";
  for (int64_t i = 0; i < n; ++i) figure.row_labels.push_back("t" + std::to_string(i));
  figure.col_labels = figure.row_labels;
  HeatmapPanel panel{"head 0", "", n, n, weights};
  figure.sections.push_back({"", {panel}});
  figure.print_values = print_values;
  return figure;
}

// The pixel at (x, y) of a PNG, as 0xAARRGGBB (alpha forced to ff for opaque formats).
struct Png {
  explicit Png(const std::string& path) : surface(cairo_image_surface_create_from_png(path.c_str())) {}
  ~Png() { cairo_surface_destroy(surface); }
  bool ok() const { return cairo_surface_status(surface) == CAIRO_STATUS_SUCCESS; }
  int width() const { return cairo_image_surface_get_width(surface); }
  int height() const { return cairo_image_surface_get_height(surface); }
  uint32_t pixel(int x, int y) const {
    const unsigned char* row = cairo_image_surface_get_data(surface) + y * cairo_image_surface_get_stride(surface);
    return reinterpret_cast<const uint32_t*>(row)[x] | 0xff000000u;
  }
  cairo_surface_t* surface;
};

TEST(Heatmap, PngHasTheLayoutSizeAndCausalCellsHaveTheirWeightsColours) {
  constexpr int64_t n = 7;
  const std::vector<float> weights = causal_weights(n, 11);
  const std::string path = temp_path("causal.png");
  const HeatmapLayout layout = qkv::cli::plot::draw_heatmaps(one_panel_figure(weights, n, /*print_values=*/true), path);
  ASSERT_EQ(layout.panels.size(), 1u);
  EXPECT_DOUBLE_EQ(layout.value_max, 1.0);  // row 0 sees only itself: weight 1

  Png png(path);
  ASSERT_TRUE(png.ok());
  EXPECT_EQ(png.width(), layout.width);
  EXPECT_EQ(png.height(), layout.height);
  const uint32_t zero = qkv::cli::plot::colormap_argb(0.0), one = qkv::cli::plot::colormap_argb(1.0);
  // Probe each cell one pixel inside its top-left corner: clear of the centred value text.
  const auto cell_pixel = [&](int64_t i, int64_t j) {
    return png.pixel(static_cast<int>(layout.panels[0].x + static_cast<double>(j) * layout.cell) + 2,
                     static_cast<int>(layout.panels[0].y + static_cast<double>(i) * layout.cell) + 2);
  };
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i + 1; j < n; ++j) {
      EXPECT_EQ(cell_pixel(i, j), zero) << "cell (" << i << ", " << j << ") above the diagonal";
    }
  }
  EXPECT_EQ(cell_pixel(0, 0), one) << "the one-token row's diagonal has weight 1";
  // A visible cell of weight strictly between 0 and 1 has neither end's colour.
  EXPECT_NE(cell_pixel(n - 1, 0), zero);
  EXPECT_NE(cell_pixel(n - 1, 0), one);
  std::filesystem::remove(path);
}

// A masked pair is hatched grey, never a colour of the scale: a weight of 0 the mask hides looks
// unlike a visible weight that is merely near 0 (viridis' dark purple).
TEST(Heatmap, MaskedCellsAreHatchedGreyNotTheColourOfZero) {
  constexpr int64_t n = 7;
  const std::vector<float> weights = causal_weights(n, 11);
  HeatmapFigure figure = one_panel_figure(weights, n, /*print_values=*/false);
  HeatmapPanel& panel = figure.sections[0].panels[0];
  panel.masked.assign(static_cast<size_t>(n * n), 0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = i + 1; j < n; ++j) panel.masked[static_cast<size_t>(i * n + j)] = 1;
  panel.values[static_cast<size_t>((n - 1) * n)] = 0.0f;  // a visible weight of exactly 0
  const std::string path = temp_path("masked.png");
  const HeatmapLayout layout = qkv::cli::plot::draw_heatmaps(figure, path);
  Png png(path);
  ASSERT_TRUE(png.ok());
  const auto at = [&](int64_t i, int64_t j, int dx, int dy) {
    return png.pixel(static_cast<int>(layout.panels[0].x + static_cast<double>(j) * layout.cell) + dx,
                     static_cast<int>(layout.panels[0].y + static_cast<double>(i) * layout.cell) + dy);
  };
  const auto byte = [](double v) { return static_cast<uint32_t>(v * 65535.0 + 0.5) >> 8; };
  const qkv::cli::plot::Rgb h = qkv::cli::plot::kMaskedHatchColour;
  const uint32_t hatch = 0xff000000u | byte(h.r) << 16 | byte(h.g) << 8 | byte(h.b);
  const uint32_t grey = qkv::cli::plot::masked_argb(), zero = qkv::cli::plot::colormap_argb(0.0);
  ASSERT_NE(grey, zero);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i + 1; j < n; ++j) {
      EXPECT_EQ(at(i, j, 2, 2), grey) << "masked cell (" << i << ", " << j << ")";
      EXPECT_EQ(at(i, j, 3, 0), hatch) << "masked cell (" << i << ", " << j << ")'s hatching";
      EXPECT_EQ(at(i, j, 5, 2), hatch) << "masked cell (" << i << ", " << j << ")'s hatching";
    }
  }
  EXPECT_EQ(at(n - 1, 0, 2, 2), zero) << "a visible weight of 0 keeps the scale's colour";
  EXPECT_EQ(at(n - 1, 0, 3, 0), zero) << "and no hatching";
  EXPECT_EQ(at(0, 0, 2, 2), qkv::cli::plot::colormap_argb(1.0));
  std::filesystem::remove(path);
}

TEST(Heatmap, SvgIsOneFilledPathPerWeight) {
  constexpr int64_t n = 5;
  HeatmapFigure figure = one_panel_figure(causal_weights(n, 3), n, true);
  figure.sections.push_back({"second section", {figure.sections[0].panels[0], figure.sections[0].panels[0]}});
  const std::string path = temp_path("cells.svg");
  qkv::cli::plot::draw_heatmaps(figure, path);
  const std::string svg = read_file(path);
  ASSERT_TRUE(svg.starts_with("<?xml")) << svg.substr(0, 80);
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  // Cairo writes every solid fill as a path with fill:rgb(...); the background is a <rect>, the
  // colour bar a gradient and the text glyph <use>s, so the solid fills are exactly the cells.
  size_t cells = 0;
  for (size_t at = svg.find("fill-rule:nonzero;fill:rgb("); at != std::string::npos;
       at = svg.find("fill-rule:nonzero;fill:rgb(", at + 1)) {
    ++cells;
  }
  EXPECT_EQ(cells, static_cast<size_t>(3 * n * n));
  std::filesystem::remove(path);
}

TEST(Heatmap, PdfStartsWithItsHeader) {
  const std::string path = temp_path("figure.pdf");
  qkv::cli::plot::draw_heatmaps(one_panel_figure(causal_weights(3, 5), 3, true), path);
  EXPECT_TRUE(read_file(path).starts_with("%PDF-"));
  std::filesystem::remove(path);
}

TEST(Heatmap, BadFiguresAndExtensionsAreClearErrors) {
  const auto figure = one_panel_figure(causal_weights(3, 5), 3, true);
  try {
    qkv::cli::plot::draw_heatmaps(figure, temp_path("figure.jpg"));
    FAIL() << "expected qkv::Error";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown extension '.jpg'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(qkv::cli::plot::format_from_path("noextension"), qkv::Error);
  EXPECT_EQ(qkv::cli::plot::format_from_path("A.SVG"), qkv::cli::plot::Format::Svg);
  HeatmapFigure wrong = figure;
  wrong.row_labels.pop_back();
  EXPECT_THROW(qkv::cli::plot::draw_heatmaps(wrong, temp_path("wrong.png")), qkv::Error);
}

TEST(Analysis, PowerLawFitRecoversAKnownExponent) {
  std::vector<double> x, y, noisy;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> jitter(0.95, 1.05);
  for (double n = 256; n <= 16384; n *= 2) {
    x.push_back(n);
    y.push_back(3e-6 * std::pow(n, 2.0));
    noisy.push_back(0.5 * std::pow(n, 1.0) * jitter(rng));
  }
  const auto exact = qkv::cli::fit_power_law(x, y);
  EXPECT_EQ(exact.points, 7);
  EXPECT_NEAR(exact.slope, 2.0, 1e-12);
  EXPECT_NEAR(std::exp(exact.intercept), 3e-6, 1e-15);
  EXPECT_NEAR(qkv::cli::fit_power_law(x, noisy).slope, 1.0, 0.05);
  EXPECT_TRUE(std::isnan(qkv::cli::fit_power_law({256}, {1}).slope));
}

TEST(Analysis, CrossoverInterpolatesWhereTheFasterCurveStaysBelow) {
  using qkv::cli::find_crossover;
  // slow = N^2 / 1000, fast = N: equal at N = 1000, between the measured 512 and 1024.
  std::vector<double> x, slow, fast;
  for (double n = 128; n <= 4096; n *= 2) {
    x.push_back(n);
    slow.push_back(n * n / 1000);
    fast.push_back(n);
  }
  const auto c = find_crossover(x, slow, fast);
  EXPECT_EQ(c.first_x, 1024);
  EXPECT_NEAR(c.interpolated_x, 1000, 1e-9);  // both curves are straight lines in log-log
  // Below at a middle point but not at the end: no crossover; below from the first point: no
  // interpolation; a dip then a recovery: the run that lasts to the end counts.
  EXPECT_TRUE(std::isnan(find_crossover({1, 2, 3}, {5, 5, 5}, {6, 4, 6}).first_x));
  const auto from_start = find_crossover({1, 2, 3}, {5, 5, 5}, {1, 1, 1});
  EXPECT_EQ(from_start.first_x, 1);
  EXPECT_TRUE(std::isnan(from_start.interpolated_x));
  EXPECT_EQ(find_crossover({1, 2, 4, 8}, {5, 5, 5, 5}, {4, 6, 4, 4}).first_x, 4);
  EXPECT_TRUE(std::isnan(find_crossover({1, 2}, {5, 5}, {4, 0}).first_x));  // a cost of 0 was not measured
}

TEST(Analysis, AttentionMemoryMatchesHandComputedFigures) {
  // GPT-3: 2048 x 2048 x 4 bytes = 16 MiB per matrix; x 96 heads; x 96 layers.
  const auto m = qkv::analysis::attention_memory({.seq = 2048, .layers = 96, .heads = 96, .batch = 1, .head_dim = 128,
                                             .dtype_bytes = 4});
  EXPECT_EQ(m.matrix_elements, 4194304);
  EXPECT_EQ(m.matrix_bytes, 16 * 1024 * 1024);
  EXPECT_EQ(m.layer_bytes, int64_t{96} * 16 * 1024 * 1024);
  EXPECT_EQ(m.model_bytes, int64_t{96} * 96 * 16 * 1024 * 1024);
  EXPECT_EQ(m.course_model_bytes, int64_t{96} * 16 * 1024 * 1024);  // the course: one head per layer
  EXPECT_EQ(m.flash_layer_elements, int64_t{96} * 2048 * (128 + 1));
  EXPECT_EQ(qkv::cli::human_bytes(static_cast<double>(m.matrix_bytes)), "16 MiB");
  EXPECT_EQ(qkv::cli::human_bytes(static_cast<double>(m.layer_bytes)), "1.5 GiB");
  EXPECT_EQ(qkv::cli::group_thousands(m.layer_bytes), "1,610,612,736");
  EXPECT_THROW(qkv::analysis::attention_memory({.seq = -1, .layers = 1, .heads = 1, .batch = 1, .head_dim = 1}), qkv::Error);
  EXPECT_THROW(qkv::analysis::attention_memory({.seq = int64_t{1} << 40, .layers = 1, .heads = 1, .batch = 1, .head_dim = 1}),
               qkv::Error);
  EXPECT_THROW(qkv::cli::dtype_bytes("f8"), qkv::Error);
}

}  // namespace
