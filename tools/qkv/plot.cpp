// Cairo drawing for the qkv tools: heatmaps of attention weights and log-log line plots, into
// PNG, SVG or PDF from the same drawing calls. See plot.hpp for the figures' contracts.
//
// Every figure is drawn in two passes over the same code: a layout pass measures text on a
// scratch surface and decides the page size, then the drawing pass paints onto the real
// surface of that size.
#include "plot.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <cairo-pdf.h>
#include <cairo-svg.h>
#include <cairo.h>
#include <fmt/core.h>

#include "qkv/error.hpp"


#if defined(__SANITIZE_ADDRESS__)
// fontconfig, which cairo asks for fonts, keeps its caches until exit by design; LeakSanitizer
// would report them in every drawing program of the sanitizer build. Only that library's
// allocations are excused: a leak of ours still fails.
extern "C" const char* __lsan_default_suppressions() { return "leak:libfontconfig.so\n"; }
#endif

namespace qkv::cli::plot {
namespace {

constexpr const char* kFontFamily = "DejaVu Sans";  // fonts-dejavu-core; fontconfig substitutes

// ---------------------------------------------------------------------------------------------
// Surfaces and text

struct SurfaceDeleter {
  void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
};
struct ContextDeleter {
  void operator()(cairo_t* c) const { cairo_destroy(c); }
};
using SurfacePtr = std::unique_ptr<cairo_surface_t, SurfaceDeleter>;
using ContextPtr = std::unique_ptr<cairo_t, ContextDeleter>;

// A page of width x height points that becomes `path` when finished.
class Page {
 public:
  Page(const std::string& path, int width, int height) : path_(path), format_(format_from_path(path)) {
    switch (format_) {
      case Format::Png: surface_.reset(cairo_image_surface_create(CAIRO_FORMAT_RGB24, width, height)); break;
      case Format::Svg: surface_.reset(cairo_svg_surface_create(path.c_str(), width, height)); break;
      case Format::Pdf: surface_.reset(cairo_pdf_surface_create(path.c_str(), width, height)); break;
    }
    check(cairo_surface_status(surface_.get()));
    context_.reset(cairo_create(surface_.get()));
    // White page.
    cairo_set_source_rgb(cr(), 1, 1, 1);
    cairo_paint(cr());
  }

  cairo_t* cr() const { return context_.get(); }

  // Writes the file (PNG) or completes it (SVG, PDF); throws qkv::Error on failure.
  void finish() {
    check(cairo_status(cr()));
    context_.reset();
    if (format_ == Format::Png) check(cairo_surface_write_to_png(surface_.get(), path_.c_str()));
    cairo_surface_finish(surface_.get());
    check(cairo_surface_status(surface_.get()));
  }

 private:
  void check(cairo_status_t status) const {
    if (status != CAIRO_STATUS_SUCCESS) {
      throw Error(fmt::format("cannot write '{}': {}", path_, cairo_status_to_string(status)));
    }
  }
  std::string path_;
  Format format_;
  SurfacePtr surface_;
  ContextPtr context_;
};

// A context on a 1 x 1 image, for measuring text before the page size is known.
ContextPtr measuring_context() {
  SurfacePtr surface(cairo_image_surface_create(CAIRO_FORMAT_RGB24, 1, 1));
  return ContextPtr(cairo_create(surface.get()));  // the context keeps the surface alive
}

void set_font(cairo_t* cr, double size, bool bold) {
  cairo_select_font_face(cr, kFontFamily, CAIRO_FONT_SLANT_NORMAL,
                         bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
}

double text_width(cairo_t* cr, const std::string& text, double size, bool bold = false) {
  set_font(cr, size, bold);
  cairo_text_extents_t extents;
  cairo_text_extents(cr, text.c_str(), &extents);
  return extents.x_advance;
}

enum class Align { Left, Center, Right };

// Text whose baseline starts at (x, y) before alignment; angle in radians, counter-clockwise
// positive as read on the page (so -pi/2 reads bottom to top).
void draw_text(cairo_t* cr, double x, double y, const std::string& text, double size, Align align,
               bool bold = false, double angle = 0, Rgb colour = {0.1, 0.1, 0.1}) {
  const double width = text_width(cr, text, size, bold);
  const double shift = align == Align::Left ? 0 : align == Align::Center ? width / 2 : width;
  cairo_save(cr);
  cairo_translate(cr, x, y);
  cairo_rotate(cr, angle);
  cairo_move_to(cr, -shift, 0);
  cairo_set_source_rgb(cr, colour.r, colour.g, colour.b);
  cairo_show_text(cr, text.c_str());
  cairo_restore(cr);
}

void set_colour(cairo_t* cr, Rgb c) { cairo_set_source_rgb(cr, c.r, c.g, c.b); }

// "0.25" for scale ticks: as few decimals as the value needs, at most 3.
std::string short_number(double value) {
  std::string text = fmt::format("{:.3f}", value);
  while (text.back() == '0') text.pop_back();
  if (text.back() == '.') text.pop_back();
  return text;
}

// ---------------------------------------------------------------------------------------------
// Heatmap geometry, shared by the layout pass and the drawing pass

struct HeatmapMetrics {
  double cell = 0;
  double label_font = 12;
  int label_every = 1;            // label every k-th row/column when cells are smaller than text
  double row_label_width = 0;     // left of each grid
  bool vertical_col_labels = false;
  double col_label_height = 0;    // below each grid
  double panel_title_height = 0;  // title + subtitle above each grid
  double panel_width = 0, panel_height = 0;
  int64_t rows = 0, cols = 0;
};

constexpr double kMargin = 24;
constexpr double kTitleFont = 18, kNoteFont = 12, kHeadingFont = 14;
constexpr double kPanelTitleFont = 13, kPanelSubtitleFont = 11;
constexpr double kPanelGapX = 28, kPanelGapY = 22;
constexpr double kLabelGap = 5;          // between a grid and its labels
constexpr double kColourBarWidth = 18;
constexpr double kColourBarGap = 36;     // from the last panel to the bar
constexpr double kMaxGridSide = 340;     // a panel's grid is at most this wide or tall
constexpr double kMinCell = 6, kMaxCell = 46;
constexpr double kValueFont = 10;
constexpr double kMinCellForValues = 34;  // "0.25" at kValueFont fits with room to spare

HeatmapMetrics heatmap_metrics(cairo_t* cr, const HeatmapFigure& figure) {
  HeatmapMetrics m;
  m.rows = static_cast<int64_t>(figure.row_labels.size());
  m.cols = static_cast<int64_t>(figure.col_labels.size());
  const double side = static_cast<double>(std::max(m.rows, m.cols));
  m.cell = std::clamp(std::floor(kMaxGridSide / side), kMinCell, kMaxCell);
  m.label_font = std::clamp(m.cell * 0.8, 9.0, 12.0);
  m.label_every = std::max(1, static_cast<int>(std::ceil(m.label_font * 1.25 / m.cell)));

  double widest_row = 0, widest_col = 0;
  for (const auto& label : figure.row_labels) widest_row = std::max(widest_row, text_width(cr, label, m.label_font));
  for (const auto& label : figure.col_labels) widest_col = std::max(widest_col, text_width(cr, label, m.label_font));
  m.row_label_width = widest_row + kLabelGap;
  m.vertical_col_labels = widest_col > m.cell * m.label_every - 4;
  m.col_label_height = kLabelGap + (m.vertical_col_labels ? widest_col : m.label_font) + 4;
  m.panel_title_height = kPanelTitleFont + kPanelSubtitleFont + 10;

  double widest_title = 0;
  for (const auto& section : figure.sections)
    for (const auto& panel : section.panels)
      widest_title = std::max({widest_title, text_width(cr, panel.title, kPanelTitleFont, true),
                               text_width(cr, panel.subtitle, kPanelSubtitleFont)});
  const double grid_width = m.cell * static_cast<double>(m.cols);
  m.panel_width = m.row_label_width + std::max(grid_width, widest_title);
  m.panel_height = m.panel_title_height + m.cell * static_cast<double>(m.rows) + m.col_label_height;
  return m;
}

// The colour bar's ticks: multiples of the smallest "nice" step (1, 2, 2.5 or 5 times a power of
// ten) that leaves at least kMinTickGap between labels, plus the top value when it is no multiple.
constexpr double kMinTickGap = 24;
std::vector<double> colour_bar_ticks(double value_max, double bar_height) {
  const double max_ticks = std::max(2.0, std::floor(bar_height / kMinTickGap));
  double step = 0;
  for (double decade = 1e-3; step == 0; decade *= 10) {
    for (double nice : {1.0, 2.0, 2.5, 5.0}) {
      if (value_max / (nice * decade) + 1 <= max_ticks) {
        step = nice * decade;
        break;
      }
    }
  }
  std::vector<double> ticks;
  for (int i = 0; i * step <= value_max * (1 + 1e-9); ++i) ticks.push_back(i * step);
  if (value_max - ticks.back() > step * 0.5) ticks.push_back(value_max);
  return ticks;
}

double colour_bar_height(const HeatmapMetrics& m) {
  return std::clamp(m.cell * static_cast<double>(m.rows), 120.0, 300.0);
}

constexpr const char* kMaskedLabel = "masked";
constexpr double kSwatchGap = 14;  // from the colour bar down to the masked swatch

bool any_masked(const HeatmapFigure& figure) {
  for (const auto& section : figure.sections)
    for (const auto& panel : section.panels)
      if (std::any_of(panel.masked.begin(), panel.masked.end(), [](uint8_t f) { return f != 0; })) return true;
  return false;
}

// Diagonal hatching over the square (x0, y0, side): 45-degree lines through the pixels whose
// (x - y), counted from the corner, is 3 (mod 6). Antialiasing off: each line is one pixel.
void hatch(cairo_t* cr, double x0, double y0, double side) {
  constexpr double kHatchStep = 6;
  cairo_save(cr);
  cairo_set_antialias(cr, CAIRO_ANTIALIAS_NONE);
  cairo_rectangle(cr, x0, y0, side, side);
  cairo_clip(cr);
  set_colour(cr, kMaskedHatchColour);
  cairo_set_line_width(cr, 1);
  for (double c = 3 - kHatchStep * std::ceil(side / kHatchStep); c < side; c += kHatchStep) {
    // From a pixel before the square to a pixel past it (the clip cuts them), so no end of a
    // line falls on a pixel centre of the square.
    cairo_move_to(cr, x0 + c - 0.5, y0 - 0.5);
    cairo_line_to(cr, x0 + c + side + 1.5, y0 + side + 1.5);
  }
  cairo_stroke(cr);
  cairo_restore(cr);
}

struct HeatmapPlan {
  HeatmapMetrics metrics;
  HeatmapLayout layout;
  double title_bottom = 0;                          // y below the title and notes
  std::vector<double> heading_y;                    // per section, baseline (NaN: no heading)
  double grid_top = 0, content_right = 0;           // for the colour bar
};

HeatmapPlan plan_heatmaps(cairo_t* cr, const HeatmapFigure& figure) {
  HeatmapPlan plan;
  plan.metrics = heatmap_metrics(cr, figure);
  const HeatmapMetrics& m = plan.metrics;

  double y = kMargin + kTitleFont;
  double widest_text = text_width(cr, figure.title, kTitleFont, true);
  for (const auto& note : figure.notes) {
    y += kNoteFont + 6;
    widest_text = std::max(widest_text, text_width(cr, note, kNoteFont));
  }
  plan.title_bottom = y + 14;
  y = plan.title_bottom;

  const int columns = std::max(1, figure.columns);
  double right = kMargin;
  bool first_grid = true;
  for (const auto& section : figure.sections) {
    if (section.heading.empty()) {
      plan.heading_y.push_back(NAN);
    } else {
      y += kHeadingFont;
      plan.heading_y.push_back(y);
      y += 8;
      widest_text = std::max(widest_text, text_width(cr, section.heading, kHeadingFont, true));
    }
    const int count = static_cast<int>(section.panels.size());
    for (int p = 0; p < count; ++p) {
      const int column = p % columns;
      if (p > 0 && column == 0) y += m.panel_height + kPanelGapY;
      const double panel_left = kMargin + column * (m.panel_width + kPanelGapX);
      // Whole-point corners, so cell edges fall between pixels: no blended seams in a PNG.
      PanelPlacement placement{std::round(panel_left + m.row_label_width), std::round(y + m.panel_title_height)};
      if (first_grid) {
        plan.grid_top = placement.y;
        first_grid = false;
      }
      plan.layout.panels.push_back(placement);
      right = std::max(right, panel_left + m.panel_width);
    }
    y += m.panel_height + kPanelGapY;
  }

  double value_max = figure.value_max;
  if (value_max <= 0) {
    float largest = 0;
    for (const auto& section : figure.sections)
      for (const auto& panel : section.panels)
        for (float v : panel.values) largest = std::max(largest, v);
    value_max = std::max(0.1, std::ceil(static_cast<double>(largest) * 10.0 - 1e-6) / 10.0);
  }
  plan.layout.value_max = value_max;
  plan.layout.cell = m.cell;
  plan.content_right = right;

  double widest_tick = 0;
  for (double tick : colour_bar_ticks(value_max, colour_bar_height(m))) widest_tick = std::max(widest_tick, text_width(cr, short_number(tick), 11));
  double bar_right = right + kColourBarGap + kColourBarWidth + 6 + widest_tick + 8 + 14;
  double bottom = y - kPanelGapY;
  if (any_masked(figure)) {  // the "masked" swatch under the colour bar
    bar_right = std::max(bar_right, right + kColourBarGap + kColourBarWidth + 6 + text_width(cr, kMaskedLabel, 11));
    bottom = std::max(bottom, plan.grid_top + colour_bar_height(m) + kSwatchGap + kColourBarWidth);
  }
  plan.layout.width = static_cast<int>(std::ceil(std::max(bar_right, kMargin + widest_text) + kMargin));
  plan.layout.height = static_cast<int>(std::ceil(bottom + kMargin));
  return plan;
}

void check_heatmap_figure(const HeatmapFigure& figure) {
  const auto rows = static_cast<int64_t>(figure.row_labels.size());
  const auto cols = static_cast<int64_t>(figure.col_labels.size());
  size_t panels = 0;
  for (const auto& section : figure.sections) {
    for (const auto& panel : section.panels) {
      ++panels;
      if (panel.rows != rows || panel.cols != cols ||
          static_cast<int64_t>(panel.values.size()) != rows * cols ||
          (!panel.masked.empty() && static_cast<int64_t>(panel.masked.size()) != rows * cols)) {
        throw Error(fmt::format("heatmap panel '{}' is {} x {} with {} values (and mask flags) but the figure has {} row and {} column labels",
                                panel.title, panel.rows, panel.cols, panel.values.size(), rows, cols));
      }
    }
  }
  if (panels == 0 || rows == 0 || cols == 0) throw Error("heatmap figure has nothing to draw");
}

void draw_panel(cairo_t* cr, const HeatmapFigure& figure, const HeatmapPanel& panel, const HeatmapMetrics& m,
                PanelPlacement at, double value_max) {
  const double grid_w = m.cell * static_cast<double>(m.cols), grid_h = m.cell * static_cast<double>(m.rows);
  // Title and subtitle, left-aligned over the grid.
  draw_text(cr, at.x, at.y - kPanelSubtitleFont - 8, panel.title, kPanelTitleFont, Align::Left, true);
  draw_text(cr, at.x, at.y - 5, panel.subtitle, kPanelSubtitleFont, Align::Left, false, 0, {0.35, 0.35, 0.35});

  // Cells: one filled rectangle each (the SVG test counts them).
  const bool values_fit = figure.print_values && m.cell >= kMinCellForValues;
  cairo_save(cr);
  cairo_set_antialias(cr, CAIRO_ANTIALIAS_NONE);  // each pixel is one cell's exact colour
  const auto is_masked = [&](int64_t i, int64_t j) {
    return !panel.masked.empty() && panel.masked[static_cast<size_t>(i * m.cols + j)] != 0;
  };
  for (int64_t i = 0; i < m.rows; ++i) {
    for (int64_t j = 0; j < m.cols; ++j) {
      const double value = panel.values[static_cast<size_t>(i * m.cols + j)];
      set_colour(cr, is_masked(i, j) ? kMaskedColour : colormap(value / value_max));
      cairo_rectangle(cr, at.x + static_cast<double>(j) * m.cell, at.y + static_cast<double>(i) * m.cell, m.cell, m.cell);
      cairo_fill(cr);
    }
  }
  // Hatching over the masked cells, each clipped to itself.
  for (int64_t i = 0; i < m.rows; ++i)
    for (int64_t j = 0; j < m.cols; ++j)
      if (is_masked(i, j)) hatch(cr, at.x + static_cast<double>(j) * m.cell, at.y + static_cast<double>(i) * m.cell, m.cell);
  cairo_restore(cr);
  if (values_fit) {
    for (int64_t i = 0; i < m.rows; ++i) {
      for (int64_t j = 0; j < m.cols; ++j) {
        if (is_masked(i, j)) continue;  // a hidden pair has no weight to print
        const double value = panel.values[static_cast<size_t>(i * m.cols + j)];
        const Rgb ink = value / value_max > 0.6 ? Rgb{0.05, 0.05, 0.05} : Rgb{1, 1, 1};
        draw_text(cr, at.x + (static_cast<double>(j) + 0.5) * m.cell, at.y + (static_cast<double>(i) + 0.5) * m.cell + kValueFont * 0.36,
                  fmt::format("{:.2f}", value), kValueFont, Align::Center, false, 0, ink);
      }
    }
  }
  // Frame.
  cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
  cairo_set_line_width(cr, 1);
  cairo_rectangle(cr, at.x - 0.5, at.y - 0.5, grid_w + 1, grid_h + 1);
  cairo_stroke(cr);

  // Row labels (queries) right-aligned to the left of the grid; column labels (keys) below.
  for (int64_t i = 0; i < m.rows; i += m.label_every) {
    draw_text(cr, at.x - kLabelGap, at.y + (static_cast<double>(i) + 0.5) * m.cell + m.label_font * 0.36,
              figure.row_labels[static_cast<size_t>(i)], m.label_font, Align::Right);
  }
  for (int64_t j = 0; j < m.cols; j += m.label_every) {
    const std::string& label = figure.col_labels[static_cast<size_t>(j)];
    const double cx = at.x + (static_cast<double>(j) + 0.5) * m.cell;
    if (m.vertical_col_labels) {
      draw_text(cr, cx + m.label_font * 0.36, at.y + grid_h + kLabelGap, label, m.label_font, Align::Right, false, -M_PI / 2);
    } else {
      draw_text(cr, cx, at.y + grid_h + kLabelGap + m.label_font, label, m.label_font, Align::Center);
    }
  }
}

// A vertical colour bar from 0 (bottom) to value_max (top), drawn as one gradient.
void draw_colour_bar(cairo_t* cr, double x, double top, double height, double value_max, const std::string& label) {
  const std::vector<double> ticks = colour_bar_ticks(value_max, height);
  cairo_pattern_t* gradient = cairo_pattern_create_linear(0, top + height, 0, top);
  constexpr int kStops = 16;
  for (int s = 0; s <= kStops; ++s) {
    const double t = static_cast<double>(s) / kStops;
    const Rgb c = colormap(t);
    cairo_pattern_add_color_stop_rgb(gradient, t, c.r, c.g, c.b);
  }
  cairo_rectangle(cr, x, top, kColourBarWidth, height);
  cairo_set_source(cr, gradient);
  cairo_fill(cr);
  cairo_pattern_destroy(gradient);
  cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
  cairo_set_line_width(cr, 1);
  cairo_rectangle(cr, x - 0.5, top - 0.5, kColourBarWidth + 1, height + 1);
  cairo_stroke(cr);

  double widest = 0;
  for (double tick : ticks) {
    const double y = top + height * (1 - tick / value_max);
    cairo_move_to(cr, x + kColourBarWidth, y);
    cairo_line_to(cr, x + kColourBarWidth + 4, y);
    cairo_stroke(cr);
    draw_text(cr, x + kColourBarWidth + 6, y + 4, short_number(tick), 11, Align::Left);
    widest = std::max(widest, text_width(cr, short_number(tick), 11));
  }
  draw_text(cr, x + kColourBarWidth + 6 + widest + 8 + 11, top + height / 2, label, 12, Align::Center, false, -M_PI / 2);
}

// ---------------------------------------------------------------------------------------------
// Log-log line plots

constexpr double kPlotWidth = 430, kPlotHeight = 320;  // the axes' inner box
constexpr double kAxisLeft = 70, kAxisBottom = 52, kAxisTop = 34, kPlotGap = 40;

struct LogRange {
  double lo, hi;  // log10 of the axis ends
};

LogRange log_range(const LinePlot& plot, bool x_axis) {
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& s : plot.series) {
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (s.y[i] <= 0 || s.x[i] <= 0) continue;
      const double v = std::log10(x_axis ? s.x[i] : s.y[i]);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  if (!std::isfinite(lo)) return {0, 1};
  if (hi - lo < 0.5) {
    const double mid = (hi + lo) / 2;
    lo = mid - 0.25;
    hi = mid + 0.25;
  }
  const double pad = (hi - lo) * 0.06;
  return {lo - pad, hi + pad};
}

// "16384", "0.5", "2e-03": tick labels on log axes.
std::string tick_label(double value) {
  if (value >= 1e6 || value < 1e-3) return fmt::format("{:.0e}", value);
  if (value >= 1) return fmt::format("{:.0f}", value);
  return short_number(value);
}

// Ticks within the range: powers of two, or 1-2-5 steps per decade (1 per decade when wide).
std::vector<double> log_ticks(LogRange range, bool powers_of_two) {
  std::vector<double> ticks;
  if (powers_of_two) {
    for (int e = static_cast<int>(std::floor(range.lo / std::log10(2.0))); e <= std::ceil(range.hi / std::log10(2.0)); ++e) {
      const double v = std::pow(2.0, e);
      if (std::log10(v) >= range.lo && std::log10(v) <= range.hi) ticks.push_back(v);
    }
    return ticks;
  }
  const bool wide = range.hi - range.lo > 2.5;
  for (int e = static_cast<int>(std::floor(range.lo)); e <= static_cast<int>(std::ceil(range.hi)); ++e) {
    for (double m : wide ? std::vector<double>{1} : std::vector<double>{1, 2, 5}) {
      const double v = m * std::pow(10.0, e);
      if (std::log10(v) >= range.lo && std::log10(v) <= range.hi) ticks.push_back(v);
    }
  }
  return ticks;
}

void draw_line_plot(cairo_t* cr, const LinePlot& plot, double left, double top) {
  const LogRange xr = log_range(plot, true), yr = log_range(plot, false);
  const auto px = [&](double x) { return left + (std::log10(x) - xr.lo) / (xr.hi - xr.lo) * kPlotWidth; };
  const auto py = [&](double y) { return top + kPlotHeight - (std::log10(y) - yr.lo) / (yr.hi - yr.lo) * kPlotHeight; };

  draw_text(cr, left, top - 12, plot.title, 14, Align::Left, true);
  // Grid and ticks.
  cairo_set_line_width(cr, 1);
  for (double t : log_ticks(xr, plot.x_powers_of_two)) {
    const double x = std::round(px(t)) + 0.5;
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, x, top);
    cairo_line_to(cr, x, top + kPlotHeight);
    cairo_stroke(cr);
    draw_text(cr, x, top + kPlotHeight + 16, tick_label(t), 11, Align::Center);
  }
  for (double t : log_ticks(yr, false)) {
    const double y = std::round(py(t)) + 0.5;
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, left, y);
    cairo_line_to(cr, left + kPlotWidth, y);
    cairo_stroke(cr);
    draw_text(cr, left - 6, y + 4, tick_label(t), 11, Align::Right);
  }
  cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
  cairo_rectangle(cr, left + 0.5, top + 0.5, kPlotWidth, kPlotHeight);
  cairo_stroke(cr);
  draw_text(cr, left + kPlotWidth / 2, top + kPlotHeight + 38, plot.x_label, 12, Align::Center);
  draw_text(cr, left - 52, top + kPlotHeight / 2, plot.y_label, 12, Align::Center, false, -M_PI / 2);

  // Curves with a dot at each measurement, clipped to the axes.
  cairo_save(cr);
  cairo_rectangle(cr, left, top, kPlotWidth, kPlotHeight);
  cairo_clip(cr);
  for (const auto& s : plot.series) {
    set_colour(cr, s.colour);
    cairo_set_line_width(cr, 2);
    const double dash[] = {6, 4};
    cairo_set_dash(cr, dash, s.dashed ? 2 : 0, 0);
    bool started = false;
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (s.y[i] <= 0) continue;
      if (started) cairo_line_to(cr, px(s.x[i]), py(s.y[i]));
      else cairo_move_to(cr, px(s.x[i]), py(s.y[i]));
      started = true;
    }
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
    if (!s.dashed) {
      for (size_t i = 0; i < s.x.size(); ++i) {
        if (s.y[i] <= 0) continue;
        cairo_arc(cr, px(s.x[i]), py(s.y[i]), 3.5, 0, 2 * M_PI);
        cairo_fill(cr);
      }
    }
  }
  cairo_restore(cr);

  // Legend, top left inside the axes.
  double widest = 0;
  for (const auto& s : plot.series) widest = std::max(widest, text_width(cr, s.label, 11));
  const double row = 17, lx = left + 10, ly = top + 10;
  cairo_set_source_rgba(cr, 1, 1, 1, 0.9);
  cairo_rectangle(cr, lx, ly, widest + 44, row * static_cast<double>(plot.series.size()) + 8);
  cairo_fill(cr);
  for (size_t i = 0; i < plot.series.size(); ++i) {
    const auto& s = plot.series[i];
    const double y = ly + 4 + row * (static_cast<double>(i) + 0.5);
    set_colour(cr, s.colour);
    cairo_set_line_width(cr, 2);
    const double dash[] = {6, 4};
    cairo_set_dash(cr, dash, s.dashed ? 2 : 0, 0);
    cairo_move_to(cr, lx + 6, y);
    cairo_line_to(cr, lx + 30, y);
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
    draw_text(cr, lx + 36, y + 4, s.label, 11, Align::Left);
  }
}

}  // namespace

Format format_from_path(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const size_t dot = path.find_last_of('.');
  std::string extension = (dot == std::string::npos || (slash != std::string::npos && dot < slash)) ? "" : path.substr(dot);
  for (char& c : extension) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (extension == ".png") return Format::Png;
  if (extension == ".svg") return Format::Svg;
  if (extension == ".pdf") return Format::Pdf;
  throw Error(fmt::format("cannot tell the image format of '{}': {}; use .png, .svg or .pdf", path,
                          extension.empty() ? "it has no extension" : "unknown extension '" + extension + "'"));
}

Rgb colormap(double t) {
  // viridis (matplotlib's table) sampled at t = 0, 0.1, ..., 1; linear in between.
  static constexpr Rgb kViridis[] = {
      {0.267004, 0.004874, 0.329415}, {0.282623, 0.140926, 0.457517}, {0.253935, 0.265254, 0.529983},
      {0.206756, 0.371758, 0.553117}, {0.163625, 0.471133, 0.558148}, {0.127568, 0.566949, 0.550556},
      {0.134692, 0.658636, 0.517649}, {0.266941, 0.748751, 0.440573}, {0.477504, 0.821444, 0.318195},
      {0.741388, 0.873449, 0.149561}, {0.993248, 0.906157, 0.143936}};
  constexpr int kLast = 10;  // kViridis[kLast] is t = 1
  t = std::isfinite(t) ? std::clamp(t, 0.0, 1.0) : 0.0;
  const double position = t * kLast;
  const int i = std::min(static_cast<int>(position), kLast - 1);
  const double f = position - i;
  const Rgb& a = kViridis[i];
  const Rgb& b = kViridis[i + 1];
  return {a.r + (b.r - a.r) * f, a.g + (b.g - a.g) * f, a.b + (b.b - a.b) * f};
}

uint32_t colormap_argb(double t) {
  // What cairo stores for an opaque colour in a 24-bit image: it keeps each channel as 16 bits,
  // round(c * 65535), and an 8-bit pixel takes the high byte.
  const Rgb c = colormap(t);
  const auto byte = [](double v) { return static_cast<uint32_t>(v * 65535.0 + 0.5) >> 8; };
  return 0xff000000u | byte(c.r) << 16 | byte(c.g) << 8 | byte(c.b);
}

uint32_t masked_argb() {
  const auto byte = [](double v) { return static_cast<uint32_t>(v * 65535.0 + 0.5) >> 8; };
  return 0xff000000u | byte(kMaskedColour.r) << 16 | byte(kMaskedColour.g) << 8 | byte(kMaskedColour.b);
}

HeatmapLayout draw_heatmaps(const HeatmapFigure& figure, const std::string& path) {
  check_heatmap_figure(figure);
  format_from_path(path);  // an unknown extension fails before any work
  HeatmapPlan plan;
  {
    ContextPtr measure = measuring_context();
    plan = plan_heatmaps(measure.get(), figure);
  }
  const HeatmapMetrics& m = plan.metrics;
  Page page(path, plan.layout.width, plan.layout.height);
  cairo_t* cr = page.cr();

  double y = kMargin + kTitleFont;
  draw_text(cr, kMargin, y, figure.title, kTitleFont, Align::Left, true);
  for (const auto& note : figure.notes) {
    y += kNoteFont + 6;
    draw_text(cr, kMargin, y, note, kNoteFont, Align::Left, false, 0, {0.3, 0.3, 0.3});
  }
  size_t index = 0;
  for (size_t s = 0; s < figure.sections.size(); ++s) {
    const auto& section = figure.sections[s];
    if (!std::isnan(plan.heading_y[s])) draw_text(cr, kMargin, plan.heading_y[s], section.heading, kHeadingFont, Align::Left, true);
    for (const auto& panel : section.panels) draw_panel(cr, figure, panel, m, plan.layout.panels[index++], plan.layout.value_max);
  }
  draw_colour_bar(cr, plan.content_right + kColourBarGap, plan.grid_top, colour_bar_height(m), plan.layout.value_max, figure.scale_label);
  if (any_masked(figure)) {
    const double x = plan.content_right + kColourBarGap, top = plan.grid_top + colour_bar_height(m) + kSwatchGap;
    set_colour(cr, kMaskedColour);
    cairo_rectangle(cr, x, top, kColourBarWidth, kColourBarWidth);
    cairo_fill(cr);
    hatch(cr, x, top, kColourBarWidth);
    cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
    cairo_set_line_width(cr, 1);
    cairo_rectangle(cr, x - 0.5, top - 0.5, kColourBarWidth + 1, kColourBarWidth + 1);
    cairo_stroke(cr);
    draw_text(cr, x + kColourBarWidth + 6, top + kColourBarWidth / 2 + 4, kMaskedLabel, 11, Align::Left);
  }
  page.finish();
  return plan.layout;
}

LineLayout draw_line_plots(const LineFigure& figure, const std::string& path) {
  format_from_path(path);
  LineLayout layout;
  const double notes_height = (kNoteFont + 6) * static_cast<double>(figure.notes.size());
  const double plots_top = kMargin + kTitleFont + notes_height + 14 + kAxisTop;
  const auto count = static_cast<double>(std::max<size_t>(1, figure.plots.size()));
  layout.width = static_cast<int>(kMargin * 2 + count * (kAxisLeft + kPlotWidth) + (count - 1) * kPlotGap);
  layout.height = static_cast<int>(plots_top + kPlotHeight + kAxisBottom + kMargin);
  {
    ContextPtr measure = measuring_context();
    double widest = text_width(measure.get(), figure.title, kTitleFont, true);
    for (const auto& note : figure.notes) widest = std::max(widest, text_width(measure.get(), note, kNoteFont));
    layout.width = std::max(layout.width, static_cast<int>(std::ceil(widest + 2 * kMargin)));
  }
  Page page(path, layout.width, layout.height);
  cairo_t* cr = page.cr();
  double y = kMargin + kTitleFont;
  draw_text(cr, kMargin, y, figure.title, kTitleFont, Align::Left, true);
  for (const auto& note : figure.notes) {
    y += kNoteFont + 6;
    draw_text(cr, kMargin, y, note, kNoteFont, Align::Left, false, 0, {0.3, 0.3, 0.3});
  }
  for (size_t p = 0; p < figure.plots.size(); ++p) {
    const double left = kMargin + kAxisLeft + static_cast<double>(p) * (kAxisLeft + kPlotWidth + kPlotGap);
    draw_line_plot(cr, figure.plots[p], left, plots_top);
  }
  page.finish();
  return layout;
}

}  // namespace qkv::cli::plot
