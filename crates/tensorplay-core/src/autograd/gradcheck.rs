//! Finite-difference gradient checks (`torch.autograd.gradcheck`).

use super::{GradOptions, grad};
use crate::{DType, Error, Result, Tensor};

/// Tolerances and step of [`gradcheck`]. Defaults follow PyTorch: `eps = 1e-6`,
/// `atol = 1e-5`, `rtol = 1e-3`.
#[derive(Debug, Clone, Copy)]
pub struct GradcheckOptions {
    /// Finite-difference step.
    pub eps: f64,
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
}

impl Default for GradcheckOptions {
    fn default() -> Self {
        GradcheckOptions {
            eps: 1e-6,
            atol: 1e-5,
            rtol: 1e-3,
        }
    }
}

fn perturbed(inputs: &[Tensor], which: usize, elem: usize, delta: f64) -> Result<Vec<Tensor>> {
    let mut out = Vec::with_capacity(inputs.len());
    for (i, t) in inputs.iter().enumerate() {
        if i == which {
            let mut v = t.to_vec::<f64>()?;
            v[elem] += delta;
            out.push(Tensor::from_vec(v, t.shape())?.requires_grad_(t.requires_grad()));
        } else {
            out.push(t.detach().requires_grad_(t.requires_grad()));
        }
    }
    Ok(out)
}

/// Checks the analytical gradients of `f` against central finite differences, in float64.
///
/// `f` maps the inputs to one or more outputs. Every input that requires grad is checked
/// against every output element: the vector-Jacobian products computed by autograd must match
/// `(f(x + eps) - f(x - eps)) / 2 eps` within `atol + rtol * |numerical|`. Returns `Ok(())` or
/// an [`Error::Autograd`] naming the input, input element, output and output element that
/// disagree, with both values.
///
/// Inputs that require grad must be float64 (finite differences in float32 are too coarse).
///
/// ```
/// use tensorplay::{self as tp, autograd::{gradcheck, GradcheckOptions}, Tensor};
/// let x = Tensor::from_vec(vec![0.3f64, -1.2, 2.0], &[3])?.requires_grad_(true);
/// gradcheck(|xs| Ok(vec![xs[0].tanh()?.mul(&xs[0])?]), &[x], GradcheckOptions::default())?;
/// # Ok::<(), tp::Error>(())
/// ```
pub fn gradcheck<F>(f: F, inputs: &[Tensor], options: GradcheckOptions) -> Result<()>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>>,
{
    let checked: Vec<usize> = (0..inputs.len())
        .filter(|&i| inputs[i].requires_grad())
        .collect();
    for &i in &checked {
        if inputs[i].dtype() != DType::F64 {
            return Err(Error::UnsupportedDType {
                op: "gradcheck",
                dtype: inputs[i].dtype(),
                expected: "float64 for every input that requires grad",
            });
        }
    }
    let outputs = f(inputs)?;
    // numerical jacobian: num[input][in_elem][output][out_elem]
    let mut numerical: Vec<Vec<Vec<Vec<f64>>>> = Vec::new();
    for &i in &checked {
        let mut per_elem = Vec::new();
        for e in 0..inputs[i].numel() {
            let plus = f(&perturbed(inputs, i, e, options.eps)?)?;
            let minus = f(&perturbed(inputs, i, e, -options.eps)?)?;
            let mut per_out = Vec::new();
            for (p, m) in plus.iter().zip(&minus) {
                let p = p.to_vec_f64()?;
                let m = m.to_vec_f64()?;
                per_out.push(
                    p.iter()
                        .zip(&m)
                        .map(|(a, b)| (a - b) / (2.0 * options.eps))
                        .collect(),
                );
            }
            per_elem.push(per_out);
        }
        numerical.push(per_elem);
    }
    let diff_inputs: Vec<Tensor> = checked.iter().map(|&i| inputs[i].clone()).collect();
    for (o, out) in outputs.iter().enumerate() {
        if !out.requires_grad() {
            // every numerical derivative must then be zero
            for (ci, &i) in checked.iter().enumerate() {
                for (e, per_out) in numerical[ci].iter().enumerate() {
                    for (oe, &n) in per_out[o].iter().enumerate() {
                        if n.abs() > options.atol {
                            return Err(Error::Autograd(format!(
                                "gradcheck: output {o} does not require grad, but d out{o}[{oe}] \
                                 / d input{i}[{e}] is {n} numerically"
                            )));
                        }
                    }
                }
            }
            continue;
        }
        for oe in 0..out.numel() {
            let mut onehot = vec![0.0f64; out.numel()];
            onehot[oe] = 1.0;
            let g = Tensor::from_vec(onehot, out.shape())?.to_dtype(out.dtype())?;
            let grads = grad(
                std::slice::from_ref(out),
                &diff_inputs,
                &[Some(g)],
                GradOptions {
                    retain_graph: Some(true),
                    create_graph: false,
                    allow_unused: true,
                },
            )?;
            for (ci, &i) in checked.iter().enumerate() {
                let analytic = match &grads[ci] {
                    Some(g) => g.to_vec_f64()?,
                    None => vec![0.0; inputs[i].numel()],
                };
                for (e, a) in analytic.iter().enumerate() {
                    let n = numerical[ci][e][o][oe];
                    if (a - n).abs() > options.atol + options.rtol * n.abs()
                        || a.is_nan() != n.is_nan()
                    {
                        return Err(Error::Autograd(format!(
                            "gradcheck: jacobian mismatch for output {o} element {oe} with \
                             respect to input {i} element {e}: analytical {a}, numerical {n}"
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks second derivatives: runs [`gradcheck`] on the function that maps the inputs and
/// output gradients to the input gradients computed with `create_graph`
/// (`torch.autograd.gradgradcheck`). The output gradients are fixed pseudo-random values.
pub fn gradgradcheck<F>(f: F, inputs: &[Tensor], options: GradcheckOptions) -> Result<()>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>>,
{
    let outs = f(inputs)?;
    let n = inputs.len();
    let mut all: Vec<Tensor> = inputs.to_vec();
    for (k, o) in outs.iter().enumerate() {
        let vals: Vec<f64> = (0..o.numel())
            .map(|j| ((j * 7 + k * 3) % 11) as f64 / 11.0 - 0.4)
            .collect();
        all.push(Tensor::from_vec(vals, o.shape())?.requires_grad_(true));
    }
    let diff: Vec<usize> = (0..n).filter(|&i| inputs[i].requires_grad()).collect();
    gradcheck(
        |xs: &[Tensor]| {
            let outs = f(&xs[..n])?;
            let ins: Vec<Tensor> = diff.iter().map(|&i| xs[i].clone()).collect();
            let gos: Vec<Option<Tensor>> = xs[n..].iter().map(|t| Some(t.clone())).collect();
            let live: Vec<usize> = (0..outs.len())
                .filter(|&k| outs[k].requires_grad())
                .collect();
            let outs_live: Vec<Tensor> = live.iter().map(|&k| outs[k].clone()).collect();
            let gos_live: Vec<Option<Tensor>> = live.iter().map(|&k| gos[k].clone()).collect();
            if outs_live.is_empty() {
                return ins.iter().map(|t| t.zeros_like()).collect();
            }
            let gs = grad(
                &outs_live,
                &ins,
                &gos_live,
                GradOptions {
                    retain_graph: Some(true),
                    create_graph: true,
                    allow_unused: true,
                },
            )?;
            gs.into_iter()
                .zip(&ins)
                .map(|(g, t)| match g {
                    Some(g) => Ok(g),
                    None => t.zeros_like(),
                })
                .collect()
        },
        &all,
        options,
    )
}
