"""M* model package: Wan2.2 text- and image-to-video."""
