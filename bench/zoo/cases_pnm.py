# ruff: noqa: E501  (the constructors are written as the packages document them)
"""PhysicsNeMo 2.2.x cases. Each returns dict(model, inputs, shard, dim, ctor, [call, note,
inputs_blocks: the shapes on 2 x 2 blocks, uneven in both dims where the model allows;
model_blocks, ctor_blocks: the model there])."""

import torch

Z = torch.zeros
CASES = {}


def case(f):
    CASES[f.__name__] = f
    return f


def trained(model):
    """``model`` with every all-zero parameter filled with small seeded random values, as
    training leaves them: the diffusion U-Nets zero-initialise each residual block's last conv
    and the output conv, so an untrained model's output and input gradient are exactly zero
    and a comparison would see nothing of the layers before them."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


@case
def pnm_AFNO():
    from physicsnemo.models.afno import AFNO  # noqa: F401 (the constructor string is eval-ed)

    ctor = "AFNO(inp_shape=[36, 40], in_channels=4, out_channels=4, patch_size=[4, 4], embed_dim=16, depth=2, num_blocks=4)"
    return dict(model=eval(ctor), inputs=[Z(2, 4, 36, 40)], dim=2, ctor=ctor)


@case
def pnm_FNO():
    from physicsnemo.models.fno import FNO  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "FNO(in_channels=4, out_channels=4, decoder_layers=1, decoder_layer_size=16, dimension=2, "
        "latent_channels=8, num_fno_layers=2, num_fno_modes=6, padding=4)"
    )
    return dict(model=eval(ctor), inputs=[Z(2, 4, 35, 40)], dim=2, ctor=ctor)


@case
def pnm_DLWP():
    from physicsnemo.models.dlwp import DLWP  # noqa: F401 (the constructor string is eval-ed)

    ctor = "DLWP(nr_input_channels=2, nr_output_channels=2, nr_initial_channels=8, depth=2)"
    return dict(
        model=eval(ctor),
        inputs=[Z(1, 2, 6, 36, 36)],
        dim=3,
        ctor=ctor,
        note="cubed-sphere (B,C,6 faces,H,W); sharded along H of every face",
    )


@case
def pnm_Pangu():
    from physicsnemo.models.pangu import Pangu  # noqa: F401 (the constructor string is eval-ed)

    ctor = "Pangu(img_size=(36, 64), patch_size=(2, 4, 4), embed_dim=8, num_heads=(2, 2, 2, 2), window_size=(2, 4, 4))"
    return dict(
        model=eval(ctor).eval(),
        inputs=[Z(1, 72, 36, 64)],
        dim=2,
        ctor=ctor + ".eval()",
        note="eval(): drop_path rates are hard-coded (0..0.2)",
    )


@case
def pnm_FengWu():
    from physicsnemo.models.fengwu import Fengwu  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "Fengwu(img_size=(36, 64), pressure_level=2, embed_dim=8, patch_size=(4, 4), "
        "num_heads=(2, 2, 2, 2), window_size=(2, 4, 4))"
    )
    return dict(
        model=eval(ctor).eval(),
        inputs=[Z(1, 14, 36, 64)],
        dim=2,
        ctor=ctor + ".eval()",
        note="eval(): drop_path rates are hard-coded; output is a 6-tuple",
    )


@case
def pnm_SwinRNN():
    from physicsnemo.models.swinvrnn import SwinRNN  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "SwinRNN(img_size=(2, 32, 32), patch_size=(2, 1, 1), in_chans=4, out_chans=4, embed_dim=8, "
        "num_groups=2, num_heads=2, window_size=4)"
    )
    # on 2 x 2 blocks the deepest level (4 x 4) is one window over all four ranks: its tokens
    # are the queries' rows, the keys and values gathered whole (mpidp.sharded.tokens)
    return dict(
        model=eval(ctor),
        inputs=[Z(1, 4, 2, 32, 32)],
        dim=3,
        ctor=ctor,
    )


@case
def pnm_DiT():
    from physicsnemo.models.dit import DiT  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "DiT(input_size=(36, 40), in_channels=4, patch_size=4, out_channels=4, hidden_size=16, depth=2, "
        "num_heads=2, condition_dim=8, attention_backend='timm')"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 4, 36, 40), Z(2), Z(2, 8)],
        dim=2,
        ctor=ctor,
        note="forward(x, t, condition): t and condition plain tensors",
    )


@case
def pnm_Pix2Pix():
    from physicsnemo.models.pix2pix import Pix2Pix  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "Pix2Pix(in_channels=3, out_channels=3, dimension=2, conv_layer_size=8, n_downsampling=2, "
        "n_upsampling=2, n_blocks=2, batch_norm=True, padding_type='reflect')"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 3, 36, 40)],
        inputs_blocks=[Z(2, 3, 35, 41)],  # 18/17 x 21/20 over 2 x 2
        dim=2,
        ctor=ctor,
    )


@case
def pnm_SongUNet():
    from physicsnemo.models.diffusion_unets import SongUNet  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "SongUNet(img_resolution=[36, 40], in_channels=3, out_channels=3, model_channels=8, "
        "channel_mult=[1, 2], num_blocks=1, attn_resolutions=[18], dropout=0.0)"
    )
    return dict(
        model=trained(eval(ctor)),
        inputs=[Z(2, 3, 36, 40), Z(2)],
        dim=2,
        ctor=ctor,
        note="forward(x, noise_labels); attention at 18x20; zero-initialised parameters filled (trained())",
    )


@case
def pnm_SRResNet():
    from physicsnemo.models.srrn import SRResNet  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "SRResNet(in_channels=2, out_channels=2, large_kernel_size=5, small_kernel_size=3, "
        "conv_layer_size=8, n_resid_blocks=2, scaling_factor=2)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(1, 2, 7, 33, 10)],
        inputs_blocks=[Z(1, 2, 7, 33, 11)],  # 17/16 x 6/5 over 2 x 2
        dim=3,
        ctor=ctor,
        note="3-D model: input (B,C,D,H,W), sharded along H",
    )


@case
def pnm_UNet3D():
    from physicsnemo.models.unet import UNet  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "UNet(in_channels=2, out_channels=2, model_depth=2, feature_map_channels=(4, 4, 8, 8), "
        "num_conv_blocks=2, normalization='groupnorm', normalization_args={'num_groups': 2}, "
        "gradient_checkpointing=False)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(1, 2, 4, 36, 8)],
        inputs_blocks=[Z(1, 2, 4, 36, 12)],  # the skips need H, W / 4: 9 x 3 at the bottom, uneven
        dim=3,
        ctor=ctor,
    )


@case
def pnm_ModAFNO():
    from physicsnemo.models.afno import ModAFNO  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "ModAFNO(inp_shape=[36, 40], in_channels=4, out_channels=4, patch_size=[4, 4], embed_dim=16, "
        "mod_dim=64, depth=2, num_blocks=4)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 4, 36, 40), Z(2, 1)],
        dim=2,
        ctor=ctor,
        note="forward(x, mod), mod (B,1) plain",
    )


@case
def pnm_DhariwalUNet():
    from physicsnemo.models.diffusion_unets import DhariwalUNet  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "DhariwalUNet(img_resolution=36, in_channels=3, out_channels=3, model_channels=64, "
        "channel_mult=[1, 1], num_blocks=1, attn_resolutions=[18], dropout=0.0)"
    )
    return dict(
        model=trained(eval(ctor)),
        inputs=[Z(2, 3, 36, 36), Z(2)],
        dim=2,
        ctor=ctor,
        note="zero-initialised parameters filled (trained()): untrained, its output is zero",
    )


@case
def pnm_DPOTNet():
    from physicsnemo.models.dpot.dpot import DPOTNet  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "DPOTNet(inp_shape=(36, 40), patch_size=(4, 4), in_channels=3, out_channels=3, in_timesteps=2, "
        "out_timesteps=1, embed_dim=16, depth=2, num_blocks=4, modes=6, out_layer_dim=8, norm_groups=4)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 36, 40, 2, 3)],
        dim=1,
        ctor=ctor,
        note="input (B,H,W,T,C): sharded along dim 1 (H)",
    )


@case
def pnm_Transolver():
    from physicsnemo.models.transolver import Transolver  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "Transolver(functional_dim=3, out_dim=2, structured_shape=(35, 40), unified_pos=True, ref=4, "
        "n_layers=2, n_hidden=16, n_head=2, slice_num=8, use_te=False)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 35, 40, 3)],
        dim=1,
        ctor=ctor,
        note="structured 2-D, input (B,H,W,C): sharded along dim 1 (H)",
    )


@case
def pnm_Transolver_mesh():
    from physicsnemo.models.transolver import Transolver  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "Transolver(functional_dim=2, embedding_dim=3, out_dim=2, structured_shape=None, unified_pos=False, "
        "n_layers=2, n_hidden=16, n_head=2, slice_num=8, use_te=False)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 101, 2), Z(2, 101, 3)],
        dim=1,
        ctor=ctor,
        note="unstructured mesh, forward(fx, embedding) (B,N,C): fx sharded along N, embedding plain",
    )


@case
def pnm_FLARE():
    from physicsnemo.models.flare import FLARE  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "FLARE(functional_dim=3, out_dim=2, structured_shape=(35, 40), unified_pos=True, ref=4, "
        "n_layers=2, n_hidden=16, n_head=2, slice_num=8)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 35, 40, 3)],
        dim=1,
        ctor=ctor,
        note="structured 2-D, input (B,H,W,C): sharded along dim 1 (H)",
    )


@case
def pnm_GeoTransolver():
    from physicsnemo.models.geotransolver import GeoTransolver  # noqa: F401 (the constructor string is eval-ed)

    ctor = "GeoTransolver(functional_dim=4, out_dim=3, n_hidden=16, n_layers=2, n_head=2, slice_num=8, use_te=False)"
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 101, 4)],
        dim=1,
        ctor=ctor,
        note="tokens (B,N,C): sharded along N",
    )


@case
def pnm_One2ManyRNN():
    from physicsnemo.models.rnn import One2ManyRNN  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "One2ManyRNN(input_channels=3, dimension=2, nr_latent_channels=8, activation_fn='relu', "
        "nr_downsamples=2, nr_tsteps=3)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 3, 1, 36, 40)],
        dim=3,
        ctor=ctor,
        note="input (B,C,T,H,W): sharded along H",
    )


@case
def pnm_Seq2SeqRNN():
    from physicsnemo.models.rnn import Seq2SeqRNN  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "Seq2SeqRNN(input_channels=3, dimension=2, nr_latent_channels=8, activation_fn='relu', "
        "nr_downsamples=2, nr_tsteps=3)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 3, 3, 36, 40)],
        dim=3,
        ctor=ctor,
        note="input (B,C,T,H,W): sharded along H",
    )


@case
def pnm_TopoDiff():
    from physicsnemo.models.topodiff import TopoDiff  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "TopoDiff(img_resolution=36, in_channels=2, out_channels=1, model_channels=32, channel_mult=[1, 2], "
        "num_blocks=1, attn_resolutions=[18], dropout=0.0)"
    )
    return dict(
        model=trained(eval(ctor)),
        inputs=[Z(2, 1, 36, 36), Z(2, 1, 36, 36), Z(2)],
        dim=2,
        ctor=ctor,
        note="forward(x, cons, timesteps): x sharded, cons plain; zero-initialised parameters filled (trained())",
    )


def _healpix_configs():
    """The encoder and decoder configurations of PhysicsNeMo's own HEALPixUNet tests (hydra
    ``_target_`` dicts), with 8 channels at each of the three levels."""
    import omegaconf

    act = {"_target_": "physicsnemo.nn.CappedGELU", "cap_value": 10}
    layers = "physicsnemo.models.dlwp_healpix.layers"
    conv = {
        "_target_": f"{layers}.ConvNeXtBlock",
        "in_channels": 3,
        "out_channels": 1,
        "activation": act,
        "kernel_size": 3,
        "dilation": 1,
        "upscale_factor": 4,
        "_recursive_": True,
    }
    down = {"_target_": "physicsnemo.nn.HEALPixAvgPool", "pooling": 2}
    up = {
        "_target_": f"{layers}.TransposedConvUpsample",
        "in_channels": 3,
        "out_channels": 1,
        "activation": act,
        "upsampling": 2,
    }
    out = {
        "_target_": f"{layers}.BasicConvBlock",
        "in_channels": 3,
        "out_channels": 2,
        "kernel_size": 1,
        "dilation": 1,
        "n_layers": 1,
    }
    common = {"conv_block": conv, "_recursive_": False, "n_channels": [8, 8, 8]}
    encoder = {
        "_target_": f"{layers}.UNetEncoder",
        "down_sampling_block": down,
        "dilations": [1, 2, 4],
        **common,
    }
    decoder = {
        "_target_": f"{layers}.UNetDecoder",
        "up_sampling_block": up,
        "output_layer": out,
        "dilations": [4, 2, 1],
        **common,
    }
    return omegaconf.DictConfig(encoder), omegaconf.DictConfig(decoder)


@case
def pnm_HEALPixUNet():
    from physicsnemo.models.dlwp_healpix import HEALPixUNet  # noqa: F401 (the constructor string is eval-ed)

    encoder, decoder = _healpix_configs()  # noqa: RUF059 (used by the eval-ed constructor)
    ctor = (
        "HEALPixUNet(encoder=encoder, decoder=decoder, input_channels=2, output_channels=2, n_constants=0, "
        "decoder_input_channels=0, input_time_dim=1, output_time_dim=1)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(1, 12, 1, 2, 16, 16)],
        dim=4,
        call=lambda m, x: m([x]),
        ctor=ctor,
        note="HEALPix faces (B,F=12,T,C,H,W): sharded along H of every face; forward([x])",
    )
