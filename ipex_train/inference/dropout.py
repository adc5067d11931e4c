"""Replace every dropout module by nn.Identity for inference."""
from torch import nn

# Every dropout variant torch.nn ships; subclasses (user dropouts built on them) are replaced too.
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def replace_dropout(model):
    """Replace, in place, every Dropout/Dropout1d/2d/3d/AlphaDropout/FeatureAlphaDropout module of ``model`` by
    nn.Identity; returns how many registrations were replaced. In eval mode these are already identities, so
    outputs do not change; removing them takes them out of traced graphs. Functional dropout calls inside a
    forward (F.dropout) are not modules and stay: they are no-ops whenever training=False is passed to them."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _DROPOUTS):
                setattr(parent, name, nn.Identity())
                replaced += 1
    return replaced
