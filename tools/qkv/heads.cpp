// `qkv heads`: what every attention head of a Hugging Face model does, measured on the model
// (qkv::models::head_roles.hpp): a table of each head's previous-token, first-token, self,
// induction and broad scores and the role they name, and a picture of the scores.
//
//   qkv heads --model DIR
//   qkv heads --model DIR "The cat sat on the mat because it was tired." -o heads.png
#include <map>
#include <memory>
#include <string>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "plot.hpp"
#include "pretrained.hpp"
#include "qkv/error.hpp"

namespace qkv::cli {
namespace {

// A paragraph with repeated names and phrases, so previous-token and copying heads have
// something to do when no text is given.
constexpr const char* kDefaultText =
    "When Mary and John went to the store, John gave a drink to Mary. The store was closed, so Mary "
    "and John walked home, and John said that the store would open again tomorrow.";

struct HeadsOptions {
  std::string folder;
  std::string text = kDefaultText;
  std::string output;     // a picture of the scores, if given
  int64_t repeat = 24;    // the induction sequence's length
  uint64_t seed = 0;
};

void print_table(const std::vector<models::HeadRoleScores>& heads) {
  fmt::print("{:>5} {:>4}  {:>8} {:>8} {:>8} {:>9} {:>8}  {}\n", "layer", "head", "previous", "first", "self",
             "induction", "broad", "role");
  for (const auto& h : heads)
    fmt::print("{:>5} {:>4}  {:>8.3f} {:>8.3f} {:>8.3f} {:>9.3f} {:>8.3f}  {}\n", h.layer, h.head, h.previous_token,
               h.first_token, h.self, h.induction, h.broad, models::to_string(h.role));
  std::map<models::HeadRole, int> counts;
  for (const auto& h : heads) ++counts[h.role];
  std::string summary;
  for (const auto& [role, count] : counts)
    summary += fmt::format("{}{} {}", summary.empty() ? "" : ", ", count, models::to_string(role));
  fmt::print("{} heads: {} (thresholds: previous-token {}, first-token {}, self {}, induction {}, broad {})\n",
             heads.size(), summary, models::kRoleThresholds[1], models::kRoleThresholds[2], models::kRoleThresholds[3],
             models::kRoleThresholds[4], models::kRoleThresholds[5]);
}

// One panel per role: layers down, heads across, the score as the colour.
void draw_picture(const std::vector<models::HeadRoleScores>& heads, const models::ModelConfig& c,
                  const std::string& folder, const std::string& output) {
  plot::HeatmapFigure figure;
  figure.title = fmt::format("Head roles of {} ({} layers x {} heads)", folder, c.num_layers, c.num_heads);
  figure.notes.push_back("each cell: one head's score for the role, 0 to 1 (qkv heads prints the table)");
  for (int64_t l = 0; l < c.num_layers; ++l) figure.row_labels.push_back(fmt::format("L{}", l));
  for (int64_t h = 0; h < c.num_heads; ++h) figure.col_labels.push_back(fmt::format("H{}", h));
  figure.value_max = 1;
  figure.scale_label = "role score";
  figure.print_values = false;
  figure.columns = 5;
  const std::pair<const char*, double models::HeadRoleScores::*> roles[] = {
      {"previous-token", &models::HeadRoleScores::previous_token}, {"first-token", &models::HeadRoleScores::first_token},
      {"self", &models::HeadRoleScores::self}, {"induction", &models::HeadRoleScores::induction},
      {"broad", &models::HeadRoleScores::broad}};
  plot::HeatmapSection section;
  for (const auto& [name, score] : roles) {
    plot::HeatmapPanel panel;
    panel.title = name;
    panel.rows = c.num_layers;
    panel.cols = c.num_heads;
    panel.values.resize(static_cast<size_t>(c.num_layers * c.num_heads));
    for (const auto& h : heads)
      panel.values[static_cast<size_t>(h.layer * c.num_heads + h.head)] = static_cast<float>(h.*score);
    section.panels.push_back(std::move(panel));
  }
  figure.sections.push_back(std::move(section));
  const plot::HeatmapLayout drawn = plot::draw_heatmaps(figure, output);
  fmt::print("Wrote the role scores to {} ({} x {})\n", output, drawn.width, drawn.height);
}

void run_heads(const HeadsOptions& o) {
  if (!o.output.empty()) plot::format_from_path(o.output);  // a bad extension fails before the work
  if (o.repeat < 2 || o.repeat > 1024)
    throw Error(fmt::format("--repeat must be between 2 and 1024, got {}", o.repeat));
  const models::Pretrained model = models::load_pretrained(o.folder);
  const std::vector<int64_t> ids = encode_text(model, o.text);
  if (ids.size() < 2) throw Error(fmt::format("the text has {} token; give at least 2", ids.size()));
  const int64_t positions = model.config.max_positions;
  fmt::print("{}: {}, measured on {} tokens of text{} and {} random tokens repeated twice\n", o.folder,
             models::to_string(model.config.architecture), std::min<int64_t>(std::ssize(ids), positions),
             std::ssize(ids) > positions ? fmt::format(" (the first {}: its positions)", positions) : "",
             std::min<int64_t>(o.repeat, positions / 2));
  const std::vector<models::HeadRoleScores> heads = measure_roles(model, ids, o.repeat, o.seed);
  print_table(heads);
  if (!o.output.empty()) draw_picture(heads, model.config, o.folder, o.output);
}

}  // namespace

void add_heads_command(CLI::App& app) {
  auto options = std::make_shared<HeadsOptions>();
  CLI::App* cmd = app.add_subcommand(
      "heads", "What each head of a Hugging Face model does: previous-token, first-token, self, induction, broad");
  cmd->add_option("--model", options->folder, "A Hugging Face model folder (config.json, model.safetensors, tokenizer)")
      ->required();
  cmd->add_option("text", options->text, "The text to measure on (default: a paragraph with repeated names)");
  cmd->add_option("-o,--output", options->output, "Also draw the scores: .png, .svg or .pdf");
  cmd->add_option("--repeat", options->repeat, "Length of the random sequence repeated for the induction score")
      ->capture_default_str();
  cmd->add_option("--seed", options->seed, "Seed of the random sequence")->capture_default_str();
  cmd->callback([options] { run_heads(*options); });
}

}  // namespace qkv::cli
