# ruff: noqa: E501  (the constructors are written as the packages document them)
"""CREDIT (miles-credit 2026.2.0) cases. Input layout (B, C, T, H, W); sharded along H (dim 3)."""

import os

import torch

Z = torch.zeros
CASES = {}
# channels=2 x levels=2 + surface 2 + input-only 1 = 7 input channels, 6 output channels
COMMON = "channels=2, levels=2, surface_channels=2, input_only_channels=1, output_only_channels=0"
XF = (
    "dim=(8, 16, 32, 64), depth=(1, 1, 1, 1), dim_head=4, global_window_size=(2, 2, 1, 1), "
    "local_window_size=(2, 2, 2, 1), cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4)), "
    "cross_embed_strides=(4, 2, 2, 2), use_spectral_norm=False"
)


def case(f):
    CASES[f.__name__] = f
    return f


@case
def credit_CrossFormer():
    from credit.models.crossformer import CrossFormer  # noqa: F401 (the constructor string is eval-ed)

    ctor = f"CrossFormer(image_height=32, image_width=64, frames=2, {COMMON}, {XF})"
    return dict(model=eval(ctor), inputs=[Z(1, 7, 2, 32, 64)], dim=3, ctor=ctor)


@case
def credit_CrossFormer_earthpad():
    from credit.models.crossformer import CrossFormer  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        f"CrossFormer(image_height=26, image_width=56, frames=2, {COMMON}, {XF}, "
        "padding_conf={'activate': True, 'mode': 'earth', 'pad_lat': (3, 3), 'pad_lon': (4, 4)})"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(1, 7, 2, 26, 56)],
        dim=3,
        ctor=ctor,
        note="earth padding: roll by W/2, flip 3 polar rows, cat along H; circular pad W",
    )


def _camulator_cast(model, dtype):
    """Its position-bias MLP takes ``rel_pos.float()`` (float32 whatever the model's dtype):
    in float64 the MLP casts its input to its weights' dtype, the one change, so that the
    comparison runs at float64's 1e-9 (in float32 the bias MLP's weight gradients, sums over
    every window through three LayerNorms, agree to 2e-4 only, the order of the sums)."""
    from credit.models.camulator import DynamicPositionBias

    DynamicPositionBias.forward = lambda self, x: self.layers(x.to(self.layers[0].weight.dtype))
    return model.to(dtype)


@case
def credit_CAMulator():
    from credit.models.camulator import Camulator  # noqa: F401 (the constructor string is eval-ed)

    ctor = f"Camulator(image_height=32, image_width=64, frames=1, {COMMON}, {XF})"
    return dict(
        model=eval(ctor), inputs=[Z(1, 7, 1, 32, 64)], dim=3, ctor=ctor, cast=_camulator_cast
    )


@case
def credit_WXFormer():
    from credit.models.wxformer.crossformer import CrossFormer  # noqa: F401 (the constructor string is eval-ed)

    ctor = f"CrossFormer(image_height=32, image_width=64, frames=2, {COMMON}, {XF})"
    return dict(
        model=eval(ctor),
        inputs=[Z(1, 7, 2, 32, 64)],
        dim=3,
        ctor="credit.models.wxformer.crossformer." + ctor,
    )


@case
def credit_FuXi():
    from credit.models.fuxi import Fuxi  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        f"Fuxi(image_height=32, image_width=64, patch_height=4, patch_width=4, frames=2, frame_patch_size=2, "
        f"dim=16, num_groups=4, num_heads=2, depth=2, window_size=4, use_spectral_norm=False, {COMMON})"
    )
    # on 2 x 2 blocks too with its own windows of 4: the transformer's 4 x 8 field has one
    # window row, cut inside by the latitude (each rank a run of every window's tokens: its
    # query rows), and the longitude falls in the window index merged into the batch
    # (mpidp.sharded.axis_products)
    return dict(model=eval(ctor), inputs=[Z(1, 7, 2, 32, 64)], dim=3, ctor=ctor)


@case
def credit_Swin():
    from credit.models.swin import SwinTransformerV2Cr  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        f"SwinTransformerV2Cr(img_size=(32, 64), patch_size=4, window_size=4, frames=1, embed_dim=16, "
        f"depths=(2,), num_heads=(2,), {COMMON})"
    )
    return dict(model=eval(ctor), inputs=[Z(1, 7, 1, 32, 64)], dim=3, ctor=ctor)


@case
def credit_Swin_eval():
    d = credit_Swin()
    d["model"] = d["model"].eval()
    d["ctor"] += ".eval()"
    return d


@case
def credit_UNet():
    from credit.models.unet import SegmentationModel  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        f"SegmentationModel(image_height=32, image_width=64, frames=2, {COMMON}, architecture="
        "{'name': 'unet', 'encoder_name': 'resnet18', 'encoder_weights': None, 'encoder_depth': 3, "
        "'decoder_channels': [32, 32, 16]})"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(1, 7, 2, 40, 64)],
        inputs_blocks=[Z(1, 7, 2, 40, 72)],  # / 8 (3 levels): 5 x 9 at the bottom, uneven
        dim=3,
        ctor=ctor,
        note="smp.Unet(resnet18 encoder, depth 3); H=40",
    )


@case
def credit_Debugger():
    from credit.models.debugger_model import DebuggerModel  # noqa: F401 (the constructor string is eval-ed)

    ctor = f"DebuggerModel(image_height=33, image_width=40, frames=2, {COMMON})"
    return dict(model=eval(ctor), inputs=[Z(1, 7, 2, 33, 40)], dim=3, ctor=ctor)


#: every post-processing fixer of CREDIT's PostBlock on its built-in demo grid (10 x 18, seven
#: pressure levels): U, V, T, q on 7 levels (0-27), sp, precipitation, evaporation, TOA, surface
#: radiation and fluxes (28-36)
_Q = list(range(21, 28))
POST = {
    "activate": True,
    "data": {"lead_time_periods": 6},
    "skebs": {"activate": False},
    "tracer_fixer": {
        "activate": True,
        "tracer_inds": _Q,
        "tracer_thres": [0.0] * 7,
        "denorm": False,
    },
    "global_mass_fixer": {
        "activate": True,
        "activate_outside_model": False,
        "simple_demo": True,
        "midpoint": False,
        "fix_level_num": 3,
        "q_inds": _Q,
        "denorm": False,
    },
    "global_water_fixer": {
        "activate": True,
        "activate_outside_model": False,
        "simple_demo": True,
        "midpoint": False,
        "q_inds": _Q,
        "precip_ind": 29,
        "evapor_ind": 30,
        "denorm": False,
    },
    "global_energy_fixer": {
        "activate": True,
        "activate_outside_model": False,
        "simple_demo": True,
        "midpoint": False,
        "T_inds": list(range(14, 21)),
        "q_inds": _Q,
        "U_inds": list(range(7)),
        "V_inds": list(range(7, 14)),
        "TOA_rad_inds": [31, 32],
        "surf_rad_inds": [33, 34],
        "surf_flux_inds": [35, 36],
        "denorm": False,
    },
}


@case
def credit_Debugger_post():
    from credit.models.debugger_model import DebuggerModel  # noqa: F401 (the constructor string is eval-ed)

    ctor = (
        "DebuggerModel(image_height=10, image_width=18, frames=1, channels=4, levels=7, "
        "surface_channels=9, input_only_channels=1, post_conf=POST)"
    )
    return dict(
        model=eval(ctor),
        inputs=[Z(2, 38, 1, 10, 18)],
        dim=3,
        ctor=ctor,
        note="batch 2; PostBlock: tracer fixer (q[q < 0] = 0 through a mask), global mass, water and energy fixers",
    )


def _edges(h, w):
    where = os.environ.get("MPIDP_ZOO_VENVS", "/tmp/mpidp-zoo")
    path = os.path.join(where, f"edges_{h}x{w}.nc")
    if not os.path.exists(path):
        import numpy as np
        import xarray as xr

        idx = np.arange(h * w).reshape(h, w)
        e = np.concatenate(
            [
                np.stack([idx[:-1].ravel(), idx[1:].ravel()], 1),  # north-south
                np.stack([idx.ravel(), np.roll(idx, -1, 1).ravel()], 1),  # east-west, periodic
            ]
        )
        lat = np.repeat(np.linspace(-80, 80, h), w)
        lon = np.tile(np.linspace(0, 360, w, endpoint=False), h)
        d = np.hypot(lat[e[:, 0]] - lat[e[:, 1]], (lon[e[:, 0]] - lon[e[:, 1]]) % 360)
        xr.Dataset(
            {
                "edges": (("edge", "pair"), e),
                "distances": ("edge", d),
                "latitude": ("node", lat),
                "longitude": ("node", lon),
            }
        ).to_netcdf(f"{path}.{os.getpid()}.tmp")  # every rank writes its own, then renames
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    return path


def _graph_cast(model, dtype):
    """The model's own ``to`` casts its integer edge list too; cast the parameters and the
    edge attributes (plain attributes, not buffers) instead."""
    model = model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    model.edge_attr = model.edge_attr.to(dtype)
    return model


@case
def credit_Graph():
    from credit.models.graph import GraphResTransfGRU  # noqa: F401 (the constructor string is eval-ed)

    path = _edges(33, 16)  # noqa: F841 (read by the eval-ed constructor)
    ctor = (
        "GraphResTransfGRU(n_variables=2, n_surface_variables=2, n_static_variables=1, levels=2, "
        "hidden_size=16, dim_head=8, n_blocks=2, history_len=2, edge_path='edges_33x16.nc', "
        "use_spectral_norm=False)"
    )
    model = eval(ctor.replace("'edges_33x16.nc'", "path"))
    return dict(
        model=model,
        inputs=[Z(1, 7, 2, 33, 16)],
        dim=3,
        ctor=ctor,
        note="4-neighbour 33x16 lat-lon grid graph (N-S + periodic E-W), written to edges_33x16.nc",
        cast=_graph_cast,
    )
