//! [`parallelize_module`]: applies a plan of styles to the modules it names.

use tensorplay_collectives::device_mesh::DeviceMesh;
use tensorplay_core::Result;
use tensorplay_core::nn::Module;

use super::shard::invalid;
use super::style::ParallelStyle;

/// Parallelises the submodules of `module` named in `parallelize_plan` over `device_mesh`
/// (`torch.distributed.tensor.parallel.parallelize_module`), in place.
///
/// The plan maps module names to styles: dotted paths as [`ModuleFields::named_children`](tensorplay_core::nn::ModuleFields::named_children) gives
/// them (`"h.0.mlp.c_fc"`; `""` is `module` itself), where a segment `*` matches every child
/// (`"h.*.mlp.c_fc"`: that layer of every block). Entries are applied in order, each to every
/// module it matches. `device_mesh` is 1-D (for a 2-D mesh pass its tensor-parallel
/// dimension, `mesh["tp"]`). Every rank of the mesh calls it with the same plan on the same
/// (identical) model; afterwards the ranks run every forward and backward together.
/// Parameter names are unchanged: each parameter keeps its name and holds this rank's shard.
///
/// ```no_run
/// use tensorplay::{self as tp, nn::{self, Module}};
/// use tp::distributed::{self as dist, device_mesh::DeviceMesh};
/// use tp::distributed::tensor::parallel::{ColwiseParallel, RowwiseParallel, parallelize_module};
///
/// # fn main() -> tp::Result<()> {
/// dist::init_process_group("cpu", Default::default())?;
/// let mesh = DeviceMesh::from_group(&dist::default_group("mlp")?, "tp")?;
/// tp::manual_seed(0); // the same full model on every rank
/// let mut mlp = nn::Sequential::new()
///     .add(nn::Linear::new(16, 64, true)?)
///     .add(nn::ReLU::new())
///     .add(nn::Linear::new(64, 16, true)?);
/// parallelize_module(
///     &mut mlp,
///     &mesh,
///     &[("0", &ColwiseParallel::new()), ("2", &RowwiseParallel::new())],
/// )?;
/// let y = mlp.call(&tp::randn(&[8, 16])?)?; // [8, 16], the same on every rank
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`](tensorplay_core::Error::InvalidArgument) naming
/// `parallelize_plan` for a name that matches no module (listing the children where the
/// match stopped); the styles' errors (see [`ParallelStyle::apply`]), naming the module.
/// On an error, the modules planned before it are already parallelised.
pub fn parallelize_module(
    module: &mut dyn Module,
    device_mesh: &DeviceMesh,
    parallelize_plan: &[(&str, &dyn ParallelStyle)],
) -> Result<()> {
    for &(name, style) in parallelize_plan {
        let segments: Vec<&str> = if name.is_empty() {
            Vec::new()
        } else {
            name.split('.').collect()
        };
        let mut missed = None;
        let found = visit(
            module,
            &segments,
            String::new(),
            &mut missed,
            &mut |path, m| style.apply(path, m, device_mesh),
        )?;
        if found == 0 {
            let (at, children) = missed.unwrap_or_default();
            return Err(invalid(
                "parallelize_module",
                "parallelize_plan",
                format!("names of submodules; under `{at}` there are {children:?}"),
                format!("`{name}`"),
            ));
        }
    }
    Ok(())
}

/// Calls `f` on every module under `m` that `segments` match (`*` matches any child), and
/// returns how many; `missed` gets the deepest path where no child matched, and its children.
fn visit(
    m: &mut dyn Module,
    segments: &[&str],
    path: String,
    missed: &mut Option<(String, Vec<String>)>,
    f: &mut dyn FnMut(&str, &mut dyn Module) -> Result<()>,
) -> Result<usize> {
    let Some((&first, rest)) = segments.split_first() else {
        f(&path, m)?;
        return Ok(1);
    };
    let mut found = 0;
    let mut names = Vec::new();
    for (child, cm) in m.named_children_mut() {
        if first == "*" || first == child {
            let p = if path.is_empty() {
                child.clone()
            } else {
                format!("{path}.{child}")
            };
            found += visit(cm, rest, p, missed, f)?;
        }
        names.push(child);
    }
    if found == 0 && missed.is_none() {
        *missed = Some((path, names));
    }
    Ok(found)
}
