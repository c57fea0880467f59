//! The integration tests of `tensorplay-core`: the core: tensors, autograd, nn, optim, checkpoints, devices. One binary, one module per
//! concern (`cargo test -p tensorplay-core --test it MODULE::`).

mod activation_checkpoint;
mod autocast;
mod autograd_engine;
mod autograd_split;
mod bad_input;
mod checkpoint;
mod cuda_kernels;
mod devices;
mod grad_scaler;
mod kernels;
mod low_precision;
mod nn;
mod operators;
mod ops_gradcheck;
mod optim;
mod promotion;
mod proptests;
mod storage;
mod transformer_layers;
