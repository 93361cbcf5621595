#include "bench_options.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string_view>
#include <type_traits>
#include <utility>

#include "presets.h"

namespace epflow::bench {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr const char* kNoBaselines = "none";
constexpr Options::Yardstick kYardsticks[] = {
    Options::Yardstick::kAtOnce, Options::Yardstick::kOneByOne, Options::Yardstick::kInterleaved};

// Thrown by the checks below and caught by parse_options, which turns it into its error.
struct BadArgument {
  std::string message;
};

[[noreturn]] void fail(std::string message) { throw BadArgument{std::move(message)}; }

std::string in_quotes(const std::string& s) { return '"' + s + '"'; }

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// `names` comma-separated in lines of at most 96 columns, indented as the help text's.
std::string wrapped(const std::vector<std::string>& names) {
  const std::string indent(15, ' ');
  std::string out, line = indent;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string item = names[i] + (i + 1 < names.size() ? "," : "");
    if (line.size() > indent.size() && line.size() + 1 + item.size() > 96) {
      out += line + "\n";
      line = indent;
    }
    line += (line.size() > indent.size() ? " " : "") + item;
  }
  return out + line + "\n";
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.push_back(p.name);
  return names;
}

// A flag and the value given to it.
struct Arg {
  std::string flag;
  std::string value;

  // How an error names the item of a list at fault: alone when it is the whole value, else with
  // the list it is in.
  std::string in_list(const std::string& item) const {
    return item == value ? "" : " in " + in_quotes(value);
  }
};

// The items of a comma-separated list, empty ones kept: "64,,128" is a typo, not two sizes.
std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> items;
  size_t begin = 0;
  for (size_t comma; (comma = s.find(',', begin)) != std::string::npos; begin = comma + 1)
    items.push_back(s.substr(begin, comma - begin));
  items.push_back(s.substr(begin));
  return items;
}

// `item` (of a.value) as a whole number in [min, max], the whole string of it.
template <typename Int>
Int whole_number(const Arg& a, const std::string& item, Int min, Int max) {
  // from_chars reads no minus sign into an unsigned type: "-1" is negative, not a typo.
  if constexpr (std::is_unsigned_v<Int>)
    if (item.size() > 1 && item[0] == '-' &&
        std::all_of(item.begin() + 1, item.end(), [](char c) { return c >= '0' && c <= '9'; }))
      fail(a.flag + ": " + item + a.in_list(item) + " must be at least 0");
  Int n = 0;
  const char* end = item.data() + item.size();
  const auto [stop, ec] = std::from_chars(item.data(), end, n);
  if (ec == std::errc::result_out_of_range)
    fail(a.flag + ": " + in_quotes(item) + a.in_list(item) + " is out of range");
  if (ec != std::errc() || stop != end)
    fail(a.flag + ": " + in_quotes(item) + a.in_list(item) + " is not a whole number");
  if (n < min)
    fail(a.flag + ": " + item + a.in_list(item) + " must be at least " + std::to_string(min));
  if (n > max)
    fail(a.flag + ": " + item + a.in_list(item) + " must be at most " + std::to_string(max));
  return n;
}

int32_t whole_number32(const Arg& a, int64_t min, int64_t max) {
  return static_cast<int32_t>(whole_number<int64_t>(a, a.value, min, max));
}

std::vector<int64_t> whole_numbers(const Arg& a, int64_t min, int64_t max) {
  std::vector<int64_t> out;
  for (const auto& item : split_list(a.value)) out.push_back(whole_number(a, item, min, max));
  return out;
}

// `item` (of a.value) if it is one of `names`.
const std::string& one_of(const Arg& a, const std::string& item,
                          const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (n == item) return n;
  fail(a.flag + ": " + in_quotes(item) + a.in_list(item) + " is not one of " + joined(names));
}

std::vector<std::string> names_of(const Arg& a, const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const auto& item : split_list(a.value)) out.push_back(one_of(a, item, names));
  return out;
}

// Why a new file cannot be made in `folder`, or "" when it can.
std::string folder_unwritable(const std::string& folder) {
  struct stat st;
  if (stat(folder.c_str(), &st) != 0)
    return "folder " + in_quotes(folder) + ": " + std::strerror(errno);
  if (!S_ISDIR(st.st_mode)) return "folder " + in_quotes(folder) + ": " + std::strerror(ENOTDIR);
  if (access(folder.c_str(), W_OK | X_OK) != 0)
    return "folder " + in_quotes(folder) + ": " + std::strerror(errno);
  return "";
}

std::string folder_of(const std::string& path) {
  const std::string folder = std::filesystem::path(path).parent_path().string();
  return folder.empty() ? "." : folder;
}

// Why `path` cannot be written (created, or overwritten), or "" when it can.
std::string file_unwritable(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return folder_unwritable(folder_of(path));
  if (S_ISDIR(st.st_mode)) return std::strerror(EISDIR);
  return access(path.c_str(), W_OK) == 0 ? "" : std::strerror(errno);
}

std::string path_value(const Arg& a) {
  if (a.value.empty()) fail(a.flag + ": the path is empty");
  return a.value;
}

void parse_into(int argc, const char* const* argv, Options* o, bool* help) {
  bool grad_dtype_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    // The flag's value: the next argument, unless that is the next flag (a value forgotten).
    auto value = [&] {
      if (i + 1 >= argc) fail(flag + " needs a value");
      if (std::string_view(argv[i + 1]).starts_with("--"))
        fail(flag + " needs a value before " + argv[i + 1]);
      return Arg{flag, argv[++i]};
    };
    if (flag == "--help" || flag == "-h") {
      *help = true;
      return;
    } else if (flag == "--check") {
      o->check = true;
    } else if (flag == "--backward") {
      o->backward = true;
    } else if (flag == "--backward-unfused") {
      o->backward_unfused = true;
    } else if (flag == "--accumulate-grads") {
      o->accumulate_grads = true;
    } else if (flag == "--saved-gate-up-rows") {
      o->saved_gate_up_rows = whole_numbers(value(), 1, kInt64Max).at(0);
    } else if (flag == "--preset") {
      o->presets = names_of(value(), preset_names());
    } else if (flag == "--tokens") {
      for (int64_t t : whole_numbers(value(), 1, kInt64Max)) o->tokens.push_back(t);
    } else if (flag == "--ep") {
      o->ep = whole_number32(value(), 1, kInt32Max);
    } else if (flag == "--iters") {
      o->iters = whole_number32(value(), 1, kInt32Max);
    } else if (flag == "--warmup") {
      o->warmup = whole_number32(value(), 0, kInt32Max);
    } else if (flag == "--settle-ms") {
      o->settle_ms = whole_number32(value(), 0, 600000);
    } else if (flag == "--repeats") {
      o->repeats = whole_number32(value(), 1, 9);
    } else if (flag == "--seed") {
      const Arg a = value();
      o->seed = whole_number<uint64_t>(a, a.value, 0, std::numeric_limits<uint64_t>::max());
    } else if (flag == "--json") {
      o->json = path_value(value());
    } else if (flag == "--trace") {
      o->trace = path_value(value());
    } else if (flag == "--baselines") {
      const Arg a = value();
      o->baselines = names_of(a, {kNcclCublas, kUnfused, kNoBaselines});
      if (o->baselines == std::vector<std::string>{kNoBaselines}) {
        o->baselines.clear();
      } else if (std::find(o->baselines.begin(), o->baselines.end(), kNoBaselines) !=
                 o->baselines.end()) {
        fail(a.flag + ": " + in_quotes(a.value) + " lists " + kNoBaselines + " beside baselines");
      }
    } else if (flag == "--grad-dtype") {
      const Arg a = value();
      o->fp32_grads = one_of(a, a.value, {"bf16", "fp32"}) == "fp32";
      grad_dtype_given = true;
    } else if (flag == "--dtype") {
      const Arg a = value();
      o->fp8 = one_of(a, a.value, {"bf16", "fp8"}) == "fp8";
    } else if (flag == "--routing") {
      const Arg a = value();
      std::vector<std::string> names;
      for (auto kind : kRoutingKinds) names.push_back(routing_name(kind));
      o->routing = kRoutingKinds[&one_of(a, a.value, names) - names.data()];
    } else if (flag == "--yardstick") {
      const Arg a = value();
      std::vector<std::string> names;
      for (auto y : kYardsticks) names.push_back(yardstick_mode(y).name);
      o->yardstick = kYardsticks[&one_of(a, a.value, names) - names.data()];
    } else if (flag == "--backward-side-sms") {
      for (int64_t n : whole_numbers(value(), 0, kInt32Max)) o->backward_side_sms.push_back(n);
    } else if (flag == "--backward-comm-sms") {
      for (int64_t n : whole_numbers(value(), 1, kInt32Max)) o->backward_comm_sms.push_back(n);
    } else if (flag == "--comm-sms") {
      for (int64_t n : whole_numbers(value(), 0, kInt32Max)) o->sweep_comm_sms.push_back(n);
    } else if (flag == "--minibatch-rows") {
      for (int64_t n : whole_numbers(value(), 0, kInt64Max)) o->sweep_minibatch_rows.push_back(n);
    } else if (flag == "--ring-rows") {
      for (int64_t n : whole_numbers(value(), 0, kInt64Max)) o->sweep_ring_rows.push_back(n);
    } else if (flag.starts_with("-")) {
      fail("unknown flag " + flag);
    } else {
      fail("unexpected argument " + in_quotes(flag));
    }
  }
  // The backward's own flags do nothing without it: say so rather than time less than asked.
  if (!o->backward) {
    if (o->backward_unfused) fail("--backward-unfused needs --backward");
    if (!o->backward_side_sms.empty()) fail("--backward-side-sms needs --backward");
    if (!o->backward_comm_sms.empty()) fail("--backward-comm-sms needs --backward");
    if (grad_dtype_given) fail("--grad-dtype needs --backward");
    if (o->accumulate_grads) fail("--accumulate-grads needs --backward");
    if (o->saved_gate_up_rows > 0) fail("--saved-gate-up-rows needs --backward");
  }
  if (o->fp8 && (o->backward_unfused || !o->backward_side_sms.empty()))
    fail("--dtype fp8: the unfused backward is bf16 only");
  if (!o->json.empty())
    if (const std::string why = file_unwritable(o->json); !why.empty())
      fail("--json: cannot write " + in_quotes(o->json) + ": " + why);
  if (!o->trace.empty())
    if (const std::string why = folder_unwritable(folder_of(o->trace)); !why.empty())
      fail("--trace: cannot write " + in_quotes(o->trace + "-<preset>-<tokens>-rank<r>.csv") + ": " +
           why);
}

}  // namespace

YardstickMode yardstick_mode(Options::Yardstick y) {
  switch (y) {
    case Options::Yardstick::kOneByOne: return {"one-by-one", "one GPU after the other"};
    case Options::Yardstick::kInterleaved:
      return {"interleaved", "dense GEMMs between the layer's calls, copy at once"};
    default: return {"at-once", "all GPUs at once"};
  }
}

ParseResult parse_options(int argc, const char* const* argv) {
  ParseResult result;
  bool help = false;
  try {
    parse_into(argc, argv, &result.options, &help);
    if (help) result.outcome = ParseResult::Outcome::kHelp;
  } catch (const BadArgument& e) {
    result.outcome = ParseResult::Outcome::kError;
    result.error = e.message;
  }
  return result;
}

std::string short_usage_text() {
  return "usage: epflow-bench [--preset NAME[,NAME...]] [--tokens T[,T...]] [--ep N] [OPTION...]\n"
         "       epflow-bench --help lists every option\n";
}

std::string usage_text() {
  return "usage: epflow-bench [--preset NAME[,NAME...]] [--tokens T[,T...]] [--ep N] [--iters N]\n"
         "                    [--warmup N] [--settle-ms N] [--repeats N] [--seed S]\n"
         "                    [--routing uniform|zipf] [--json PATH] [--baselines LIST] [--check]\n"
         "                    [--comm-sms N[,N...]] [--minibatch-rows R[,R...]]\n"
         "                    [--ring-rows R[,R...]] [--trace PREFIX]\n"
         "                    [--yardstick at-once|one-by-one|interleaved] [--backward]\n"
         "                    [--grad-dtype bf16|fp32] [--accumulate-grads] [--saved-gate-up-rows N]\n"
         "                    [--backward-unfused] [--dtype bf16|fp8]\n"
         "                    [--backward-side-sms N[,N...]] [--backward-comm-sms N[,N...]]\n"
         "  --preset     model shapes (default deepseek-v3 on GPUs, tiny on the CPU reference):\n"
         + wrapped(preset_names()) +
         "  --tokens     tokens per rank, at least 1 (default 4096 on GPUs, 64 on the CPU)\n"
         "  --ep N       ranks, at least 1 (default: every GPU present; 2 simulated on the CPU)\n"
         "  --iters N    timed calls, at least 1 (default 20)\n"
         "  --warmup N   untimed calls before the timed ones, for every system and yardstick\n"
         "               (default 100: the sustained power state at large sizes)\n"
         "  --settle-ms N  before those, untimed calls for N ms of GPU time, for every system\n"
         "               and yardstick at each point: the clock settles under the power cap\n"
         "               (default 2000; 0 to 600000)\n"
         "  --repeats N  run each point's whole sequence (systems, yardsticks) N times, 1 to 9,\n"
         "               and report the medians over the repeats (default 1)\n"
         "  --seed S     seed of the inputs and routing (default 1)\n"
         "  --routing    how tokens pick their experts, for every system and --check: uniform\n"
         "               (default) or zipf, expert popularity proportional to 1 / (1 + its place\n"
         "               in a seeded ranking, the same on every rank)\n"
         "  --json PATH  also write the results to PATH as JSON (GPU runs)\n"
         "  --dtype fp8  EPFlow's FP8 layer (e4m3, 1x128 / 128x128 scales; weights quantized\n"
         "               on the device, timed apart) first, then its bf16 layer and the\n"
         "               baselines, each ratio against it (default bf16); with --backward both\n"
         "               EPFlow layers' backward and training step, and the FP8 layer's backward\n"
         "               again with its weight-gradient GEMMs in the precision it did not choose\n"
         "  --backward   also time EPFlow's backward and its stages (dy = x, weight gradients\n"
         "               written in --grad-dtype bf16|fp32, default bf16 like the PyTorch baseline)\n"
         "  --accumulate-grads  the backward adds into the weight gradients (gradient\n"
         "               accumulation) instead of writing them\n"
         "  --saved-gate-up-rows N  rows of g|u a forward's context keeps (default: balanced\n"
         "               routing + 25%); the backward recomputes the rest\n"
         "  --backward-unfused  also time the unfused backward (separate kernels) and its stages\n"
         "               (with it, --backward-side-sms and --check, contexts keep every row's g|u)\n"
         "  --backward-side-sms N[,N...]  also time the unfused backward with N SMs for its side\n"
         "               stream (x pull, dx push beside the GEMMs; 0: none, all in order)\n"
         "  --backward-comm-sms N[,N...]  also time the backward megakernel with N communication\n"
         "               SMs (at least 1)\n"
         "               (--grad-dtype and the four flags above need --backward)\n"
         "  --baselines  systems timed after EPFlow on the same inputs: nccl-cublas and\n"
         "               epflow-unfused (bench/unfused: separate kernels) by default, or none\n"
         "  --comm-sms, --minibatch-rows, --ring-rows  also time EPFlow with each combination\n"
         "               of these knobs (system epflow-sweep; 0 = the automatic default)\n"
         "  --trace PREFIX  write EPFlow's megakernel tasks of the last timed call, per rank, to\n"
         "               PREFIX-<preset>-<tokens>-rank<r>.csv (bench/trace_summary.py reads them;\n"
         "               with --backward, the backward pass's too: ...-rank<r>-bwd.csv; with\n"
         "               --dtype fp8, the bf16 layer's too: PREFIX-bf16-<preset>-...)\n"
         "  --yardstick  cuBLAS dense and HBM copy yardsticks on every GPU at once, as the layer\n"
         "               runs (default), or one GPU after the other with the others idle, or\n"
         "               interleaved: the dense GEMMs timed between EPFlow's own timed calls (the\n"
         "               same clocks and power history; the copy still at once afterwards)\n"
         "  --check      compare EPFlow's and the baselines' outputs with the CPU reference on a\n"
         "               small shape (default: preset tiny, 64 tokens, EP 2 if 2 GPUs, else 1),\n"
         "               and EPFlow's backward (dx, d topk_weights, weight gradients; the unfused\n"
         "               one too with epflow-unfused); exit 1 on a mismatch\n"
         "  -h, --help   this text\n";
}

}  // namespace epflow::bench
