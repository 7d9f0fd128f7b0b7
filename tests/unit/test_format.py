import pytest

from fp4_dist import format as fmt


@pytest.mark.parametrize(
    "m,k,scale_shape,col_scale_shape",
    [(1, 16, (128, 4), (128, 4)), (37, 48, (128, 4), (128, 4)), (130, 80, (256, 8), (128, 12)), (256, 4096, (256, 256), (4096, 16))],
)
def test_scale_shapes_pad_rows_to_128_and_tile_columns_to_4(m, k, scale_shape, col_scale_shape):
    assert fmt.rowwise_scale_shape(m, k) == scale_shape
    assert fmt.columnwise_scale_shape(m, k) == col_scale_shape
    assert fmt.rowwise_data_shape(m, k) == (m, k // 2)
    assert fmt.columnwise_data_shape(m, k) == (k, m // 2)


def test_tile_grid_counts_ragged_edge_tiles():
    assert fmt.tile_grid(17, 48) == (2, 3)
    assert fmt.num_tiles(16, 16) == 1


@pytest.mark.parametrize("shape,match", [((16,), "2D"), ((2, 3, 16), "2D"), ((4, 24), "multiple of 16"), ((0, 16), "empty")])
def test_check_weight_shape_names_the_rule(shape, match):
    with pytest.raises(ValueError, match=match):
        fmt.check_weight_shape(shape, "w")


def test_unknown_numerics_is_refused():
    with pytest.raises(ValueError, match="numerics"):
        fmt.check_numerics("te-2.13")
