builtin.module {
  func.func @forward(%x: tensor<4x16xf32>) -> tensor<4x8xf32> {
    %w = "coopt.weight"() <{ref = "fc.weight"}> : () -> tensor<8x16xf32>
    %b = "coopt.weight"() <{ref = "fc.bias"}> : () -> tensor<8xf32>
    %y = "coopt.aten"(%x, %w, %b) <{target = "aten.linear.default", args = "{\22args\22: [{\22$t\22: 0}, {\22$t\22: 1}, {\22$t\22: 2}], \22kwargs\22: {}}"}> : (tensor<4x16xf32>, tensor<8x16xf32>, tensor<8xf32>) -> tensor<4x8xf32>
    %r = "coopt.aten"(%y) <{target = "aten.relu.default", args = "{\22args\22: [{\22$t\22: 0}], \22kwargs\22: {}}"}> : (tensor<4x8xf32>) -> tensor<4x8xf32>
    func.return %r : tensor<4x8xf32>
  }
}
