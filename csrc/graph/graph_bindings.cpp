// xmix._C.graph: the graph IR, the splice planner and (with CUDA) the applier, for
// python/xmix/graphs.py and for tests that drive the planner on hand-built graphs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <string>

#include "ir.h"
#include "planner.h"
#if defined(XMIX_WITH_CUDA)
#include "applier.h"
#endif

namespace py = pybind11;
using namespace xmix::graph;

void register_graph_bindings(py::module_& m) {
  py::module_ g = m.def_submodule("graph", "CUDA graph interposition: IR, planner, applier");

  py::enum_<NodeType>(g, "NodeType")
      .value("Kernel", NodeType::Kernel)
      .value("Memcpy", NodeType::Memcpy)
      .value("Memset", NodeType::Memset)
      .value("Host", NodeType::Host)
      .value("Child", NodeType::Child)
      .value("Empty", NodeType::Empty)
      .value("EventWait", NodeType::EventWait)
      .value("EventRecord", NodeType::EventRecord)
      .value("SemSignal", NodeType::SemSignal)
      .value("SemWait", NodeType::SemWait)
      .value("MemAlloc", NodeType::MemAlloc)
      .value("MemFree", NodeType::MemFree)
      .value("Conditional", NodeType::Conditional)
      .value("Unknown", NodeType::Unknown);
  py::enum_<Role>(g, "Role")
      .value("Foreign", Role::Foreign)
      .value("Anchor", Role::Anchor)
      .value("Op", Role::Op)
      .value("Gate", Role::Gate)
      .value("If", Role::If)
      .value("CustomSelect", Role::CustomSelect)
      .value("CustomUser", Role::CustomUser)
      .value("CustomFinish", Role::CustomFinish);

  py::class_<EdgeData>(g, "EdgeData")
      .def(py::init([](int from_port, int to_port, int type) {
             EdgeData d;
             d.from_port = static_cast<uint8_t>(from_port);
             d.to_port = static_cast<uint8_t>(to_port);
             d.type = static_cast<uint8_t>(type);
             return d;
           }),
           py::arg("from_port") = 0, py::arg("to_port") = 0, py::arg("type") = 0)
      .def_readwrite("from_port", &EdgeData::from_port)
      .def_readwrite("to_port", &EdgeData::to_port)
      .def_readwrite("type", &EdgeData::type)
      .def("is_default", &EdgeData::is_default)
      .def("__eq__", &EdgeData::operator==);

  py::class_<AnchorArgs>(g, "AnchorArgs")
      .def(py::init([](uint64_t cb, int32_t site, uint32_t rows, int32_t d, uint64_t h, uint64_t r,
                       int32_t dtype, uint32_t threads) {
             AnchorArgs a;
             a.ok = true;
             a.cb = cb;
             a.site = site;
             a.h = h;
             a.r = r;
             a.d = d;
             a.stride_h = d;
             a.stride_r = r ? d : 0;
             a.dtype = dtype;
             a.grid_x = rows;
             a.grid_y = 1;
             a.grid_z = 1;
             a.block_x = threads;
             a.block_y = 1;
             a.block_z = 1;
             a.smem = static_cast<uint32_t>(2 * d * 4);
             return a;
           }),
           py::arg("cb"), py::arg("site"), py::arg("rows"), py::arg("d") = 64, py::arg("h") = 0,
           py::arg("r") = 0, py::arg("dtype") = 0, py::arg("threads") = 256)
      .def_readwrite("ok", &AnchorArgs::ok)
      .def_readwrite("cb", &AnchorArgs::cb)
      .def_readwrite("site", &AnchorArgs::site)
      .def_readwrite("h", &AnchorArgs::h)
      .def_readwrite("r", &AnchorArgs::r)
      .def_readwrite("d", &AnchorArgs::d)
      .def_readwrite("stride_h", &AnchorArgs::stride_h)
      .def_readwrite("stride_r", &AnchorArgs::stride_r)
      .def_readwrite("dtype", &AnchorArgs::dtype)
      .def_readwrite("grid_x", &AnchorArgs::grid_x)
      .def_readwrite("grid_y", &AnchorArgs::grid_y)
      .def_readwrite("grid_z", &AnchorArgs::grid_z)
      .def_readwrite("block_x", &AnchorArgs::block_x)
      .def_readwrite("block_y", &AnchorArgs::block_y)
      .def_readwrite("block_z", &AnchorArgs::block_z)
      .def_readwrite("smem", &AnchorArgs::smem);

  py::class_<Node>(g, "Node")
      .def(py::init([](int32_t id, NodeType type, Role role, int32_t parent, bool enabled,
                       const AnchorArgs* anchor) {
             Node n;
             n.id = id;
             n.type = type;
             n.role = role;
             n.parent = parent;
             n.enabled = enabled;
             if (anchor) n.anchor = *anchor;
             return n;
           }),
           py::arg("id"), py::arg("type") = NodeType::Kernel, py::arg("role") = Role::Foreign,
           py::arg("parent") = -1, py::arg("enabled") = true, py::arg("anchor") = nullptr)
      .def_readwrite("id", &Node::id)
      .def_readwrite("type", &Node::type)
      .def_readwrite("role", &Node::role)
      .def_readwrite("parent", &Node::parent)
      .def_readwrite("enabled", &Node::enabled)
      .def_readwrite("anchor", &Node::anchor)
      .def("__repr__", [](const Node& n) {
        return "<Node " + std::to_string(n.id) + " " + type_name(n.type) + " " + role_name(n.role) +
               ">";
      });

  py::class_<Edge>(g, "Edge")
      .def(py::init(
               [](int32_t from, int32_t to, const EdgeData& data) { return Edge{from, to, data}; }),
           py::arg("from_"), py::arg("to"), py::arg("data") = EdgeData{})
      .def_readwrite("from_", &Edge::from)
      .def_readwrite("to", &Edge::to)
      .def_readwrite("data", &Edge::data);

  py::class_<CustomArgs>(g, "CustomArgs")
      .def(py::init<>())
      .def_readwrite("kernel", &CustomArgs::kernel)
      .def_readwrite("tok_slot", &CustomArgs::tok_slot)
      .def_readwrite("tok_pos", &CustomArgs::tok_pos)
      .def_readwrite("slot_params", &CustomArgs::slot_params)
      .def_readwrite("artifact", &CustomArgs::artifact)
      .def_readwrite("select", &CustomArgs::select)
      .def_readwrite("out", &CustomArgs::out)
      .def_readwrite("n_params", &CustomArgs::n_params)
      .def_readwrite("param_base", &CustomArgs::param_base)
      .def_readwrite("artifact_numel", &CustomArgs::artifact_numel)
      .def("__eq__", &CustomArgs::operator==);

  py::class_<Segment>(g, "Segment")
      .def(py::init<>())
      .def_readwrite("site", &Segment::site)
      .def_readwrite("op_index", &Segment::op_index)
      .def_readwrite("app", &Segment::app)
      .def_readwrite("gated", &Segment::gated)
      .def_readwrite("custom", &Segment::custom)
      .def_readwrite("enabled", &Segment::enabled)
      .def_readwrite("custom_args", &Segment::custom_args)
      .def_readwrite("gate", &Segment::gate)
      .def_readwrite("cond", &Segment::cond)
      .def_readwrite("op", &Segment::op)
      .def_readwrite("sel", &Segment::sel)
      .def_readwrite("user", &Segment::user)
      .def_readwrite("fin", &Segment::fin);

  py::class_<Splice>(g, "Splice")
      .def(py::init<>())
      .def_readwrite("anchor", &Splice::anchor)
      .def_readwrite("segments", &Splice::segments);

  py::class_<Graph>(g, "Graph")
      .def(py::init([](std::vector<Node> nodes, std::vector<Edge> edges) {
             Graph gr;
             gr.nodes = std::move(nodes);
             gr.edges = std::move(edges);
             return gr;
           }),
           py::arg("nodes") = std::vector<Node>{}, py::arg("edges") = std::vector<Edge>{})
      .def_readwrite("nodes", &Graph::nodes)
      .def_readwrite("edges", &Graph::edges)
      .def_readwrite("splices", &Graph::splices)
      .def("find",
           [](const Graph& gr, int32_t id) -> py::object {
             const Node* n = gr.find(id);
             return n ? py::cast(*n) : py::none();
           })
      .def("next_id", &Graph::next_id);

  py::class_<OpSpec>(g, "OpSpec")
      .def(py::init([](int32_t site, int32_t op_index, int32_t app, bool enabled, bool gated,
                       bool custom, const CustomArgs* args) {
             OpSpec o;
             o.site = site;
             o.op_index = op_index;
             o.app = app;
             o.enabled = enabled;
             o.gated = gated;
             o.custom = custom;
             if (args) o.custom_args = *args;
             return o;
           }),
           py::arg("site"), py::arg("op_index"), py::arg("app"), py::arg("enabled") = true,
           py::arg("gated") = false, py::arg("custom") = false, py::arg("custom_args") = nullptr)
      .def_readwrite("site", &OpSpec::site)
      .def_readwrite("op_index", &OpSpec::op_index)
      .def_readwrite("app", &OpSpec::app)
      .def_readwrite("enabled", &OpSpec::enabled)
      .def_readwrite("gated", &OpSpec::gated)
      .def_readwrite("custom", &OpSpec::custom)
      .def_readwrite("custom_args", &OpSpec::custom_args);

  py::class_<Program>(g, "Program")
      .def(py::init([](uint64_t cb, int32_t n_sites, std::vector<OpSpec> ops,
                       int32_t expected_anchors, bool use_conditionals) {
             Program p;
             p.cb = cb;
             p.n_sites = n_sites;
             p.ops = std::move(ops);
             p.expected_anchors = expected_anchors;
             p.use_conditionals = use_conditionals;
             return p;
           }),
           py::arg("cb"), py::arg("n_sites"), py::arg("ops") = std::vector<OpSpec>{},
           py::arg("expected_anchors") = -1, py::arg("use_conditionals") = true)
      .def_readwrite("cb", &Program::cb)
      .def_readwrite("n_sites", &Program::n_sites)
      .def_readwrite("ops", &Program::ops)
      .def_readwrite("expected_anchors", &Program::expected_anchors)
      .def_readwrite("use_conditionals", &Program::use_conditionals)
      .def_readwrite("threads", &Program::threads);

  py::class_<NewNode>(g, "NewNode")
      .def_readonly("role", &NewNode::role)
      .def_readonly("anchor", &NewNode::anchor)
      .def_readonly("segment", &NewNode::segment)
      .def_readonly("body_of", &NewNode::body_of);
  py::class_<NewEdge>(g, "NewEdge")
      .def_readonly("from_", &NewEdge::from)
      .def_readonly("to", &NewEdge::to)
      .def_readonly("data", &NewEdge::data);
  py::class_<Repoint>(g, "Repoint")
      .def_readonly("anchor", &Repoint::anchor)
      .def_readonly("segment", &Repoint::segment);
  py::class_<Toggle>(g, "Toggle")
      .def_readonly("node", &Toggle::node)
      .def_readonly("enabled", &Toggle::enabled);
  py::class_<Plan>(g, "Plan")
      .def_readonly("fallback", &Plan::fallback)
      .def_readonly("reason", &Plan::reason)
      .def_readonly("remove", &Plan::remove)
      .def_readonly("add", &Plan::add)
      .def_readonly("edges", &Plan::edges)
      .def_readonly("repoint", &Plan::repoint)
      .def_readonly("enable", &Plan::enable)
      .def_readonly("splices", &Plan::splices)
      .def_readonly("needs_instantiate", &Plan::needs_instantiate)
      .def_readonly("n_anchors", &Plan::n_anchors)
      .def_readonly("n_kept", &Plan::n_kept)
      .def_readonly("n_rebuilt", &Plan::n_rebuilt)
      .def("is_noop", [](const Plan& p) {
        return !p.fallback && p.remove.empty() && p.add.empty() && p.edges.empty() &&
               p.repoint.empty() && !p.needs_instantiate;
      });

  g.def("plan", &plan, py::arg("graph"), py::arg("program"),
        "Decide the splice edits for a graph against the control block's site program");
  g.def("fallback_plan", &fallback_plan, py::arg("graph"), py::arg("reason"));
  g.def("anchor_config", &anchor_config, py::arg("graph"),
        "Exec states of the anchor configuration (first-replay check): anchors on, built-in "
        "op nodes off, user kernels' nodes as recorded");
  g.def("apply", &apply, py::arg("graph"), py::arg("plan"),
        "Perform a plan on the IR (what the applier does to a cudaGraph_t)");
  g.def("describe", &describe);
  g.def("edge_list", &edge_list);
  g.def("fresh_id", &fresh_id);

#if defined(XMIX_WITH_CUDA)
  g.def("conditionals_supported", &conditionals_supported);
  g.def("copy_device", &copy_device, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        py::arg("stream"));
  g.def("nvtx_push", &nvtx_push);
  g.def("nvtx_pop", &nvtx_pop);
  g.def("nvtx_mark", &nvtx_mark);
  py::class_<GraphPatch>(g, "GraphPatch")
      .def(py::init<uint64_t>(), py::arg("graph"))
      .def_property_readonly("graph", &GraphPatch::graph)
      .def("read", &GraphPatch::read)
      .def("apply", &GraphPatch::apply, py::arg("plan"), py::arg("exec") = 0)
      .def("bind", &GraphPatch::bind, py::arg("exec"))
      .def("set_app_enabled", &GraphPatch::set_app_enabled, py::arg("exec"), py::arg("app"),
           py::arg("enabled"))
      .def("refresh_app_params", &GraphPatch::refresh_app_params, py::arg("exec"), py::arg("app"))
      .def("verify", &GraphPatch::verify, py::arg("expected"))
      .def("set_anchor_config", &GraphPatch::set_anchor_config, py::arg("exec"), py::arg("anchors"))
      .def_property_readonly("anchor_forms", &GraphPatch::anchor_forms)
      .def("try_instantiate", &GraphPatch::try_instantiate)
      .def("instantiate_own", &GraphPatch::instantiate_own, py::arg("stale"))
      .def("launch_own", &GraphPatch::launch_own, py::arg("stream"))
      .def_property_readonly("own_exec", &GraphPatch::own_exec)
      .def(
          "update",
          [](GraphPatch& self, const Program& prog, uint64_t exec, bool verify) {
            // read -> plan -> apply in one call; with verify, the graph read back must match
            // the planner's own application of the plan to the IR.
            Graph ir = self.read();
            Plan p = plan(ir, prog);
            const bool needs = self.apply(p, exec);
            std::string mismatch;
            if (verify) mismatch = self.verify(apply(ir, p));
            return py::make_tuple(p, needs, mismatch);
          },
          py::arg("program"), py::arg("exec") = 0, py::arg("verify") = false)
      .def_property_readonly("n_segments", &GraphPatch::n_segments)
      .def_property_readonly("n_parked", &GraphPatch::n_parked)
      .def_property_readonly("one_instance_at_a_time", &GraphPatch::one_instance_at_a_time);
#endif
}
