// Drawing for the qkv tools (viz, scaling): one cairo drawing code that writes PNG, SVG or PDF,
// chosen by the output file's extension. Two kinds of figure:
//
//   heatmaps   attention weights, one panel per (head, setting), token labels on both axes and
//              one colour scale shared by every panel (draw_heatmaps)
//   line plot  log-log curves, e.g. time and memory against sequence length (draw_line_plots)
//
// Units are points; a PNG has one pixel per point, so a layout's numbers are its pixel coordinates.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qkv::cli::plot {

enum class Format { Png, Svg, Pdf };

// The format named by path's extension (case-insensitive): .png, .svg or .pdf.
// Anything else throws qkv::Error naming the extension and the choices.
Format format_from_path(const std::string& path);

struct Rgb {
  double r, g, b;  // each in [0, 1]
};
// The viridis colour map (dark purple at 0, yellow at 1); t is clamped to [0, 1].
Rgb colormap(double t);
// The 8-bit colour a PNG stores for colormap(t), for tests that read pixels back.
uint32_t colormap_argb(double t);
// A masked cell's grey and its hatching's, as a PNG stores them. The hatch lines run at 45
// degrees through the points (x - y) = 3 (mod 6) of the cell's own corner, one pixel wide, so the
// pixel 2 in and 2 down from a cell's top-left corner is always the grey.
inline constexpr Rgb kMaskedColour{0.86, 0.86, 0.86};
inline constexpr Rgb kMaskedHatchColour{0.62, 0.62, 0.62};
uint32_t masked_argb();

// ---------------------------------------------------------------------------------------------
// Heatmaps

// One matrix of weights: rows = queries, cols = keys, row-major.
struct HeatmapPanel {
  std::string title;     // "head 3"
  std::string subtitle;  // "entropy 1.21 nats"
  int64_t rows = 0, cols = 0;
  std::vector<float> values;
  // Empty, or rows * cols flags: nonzero where the mask hides the pair. A masked cell is drawn
  // light grey with diagonal hatching, never in the colour scale, so it cannot be mistaken for
  // a weight near 0 (viridis' dark purple).
  std::vector<uint8_t> masked;
};

// Panels laid out in a grid of at most `columns` per line, under an optional heading.
struct HeatmapSection {
  std::string heading;  // "8 heads x 8 dims", empty for none
  std::vector<HeatmapPanel> panels;
};

struct HeatmapFigure {
  std::string title;
  std::vector<std::string> notes;       // lines under the title
  std::vector<std::string> row_labels;  // one per query (row)
  std::vector<std::string> col_labels;  // one per key (column)
  std::vector<HeatmapSection> sections;
  int columns = 3;                      // panels per line
  double value_max = 0;                 // top of the colour scale; 0: the largest value, rounded up
  std::string scale_label = "attention weight";
  bool print_values = true;             // write each weight in its cell when the cell is large enough
};

// Where draw_heatmaps put each panel's cells: cell (i, j) of panel p covers
// [x + j * cell, x + (j + 1) * cell) x [y + i * cell, y + (i + 1) * cell).
struct PanelPlacement {
  double x = 0, y = 0;
};
struct HeatmapLayout {
  int width = 0, height = 0;
  double cell = 0;                       // cell side
  double value_max = 1;                  // the colour scale is [0, value_max]
  std::vector<PanelPlacement> panels;    // in section order, then panel order
};

// Lays out and draws the figure into `path` (format by extension). Throws qkv::Error when the
// figure is empty or the labels do not match the panels, or the file cannot be written.
HeatmapLayout draw_heatmaps(const HeatmapFigure& figure, const std::string& path);

// ---------------------------------------------------------------------------------------------
// Log-log line plots, side by side

struct Series {
  std::string label;  // "reference (slope 2.01)"
  Rgb colour;
  std::vector<double> x, y;  // positive; points with y <= 0 are skipped
  bool dashed = false;
};

struct LinePlot {
  std::string title;
  std::string x_label, y_label;
  std::vector<Series> series;
  bool x_powers_of_two = true;  // x ticks at powers of two (sequence lengths), else of ten
};

struct LineFigure {
  std::string title;
  std::vector<std::string> notes;
  std::vector<LinePlot> plots;  // drawn left to right
};

struct LineLayout {
  int width = 0, height = 0;
};
LineLayout draw_line_plots(const LineFigure& figure, const std::string& path);

// Colours the tools use for the two kernels.
inline constexpr Rgb kReferenceColour{0.85, 0.33, 0.10};
inline constexpr Rgb kFlashColour{0.00, 0.45, 0.70};

}  // namespace qkv::cli::plot
