#include <stdio.h>
#include <stddef.h>
#include <infiniband/verbs.h>
#define S(t) printf("size %s %zu\n", #t, sizeof(struct t));
#define O(t,f) printf("off %s.%s %zu\n", #t, #f, offsetof(struct t, f));
int main(void){
S(ibv_device_attr) O(ibv_device_attr,max_qp_wr) O(ibv_device_attr,max_sge) O(ibv_device_attr,max_cqe) O(ibv_device_attr,max_qp_rd_atom) O(ibv_device_attr,max_qp_init_rd_atom) O(ibv_device_attr,phys_port_cnt)
S(ibv_port_attr) O(ibv_port_attr,active_mtu) O(ibv_port_attr,gid_tbl_len) O(ibv_port_attr,link_layer)
S(ibv_global_route) S(ibv_ah_attr) S(ibv_qp_attr) O(ibv_qp_attr,dest_qp_num) O(ibv_qp_attr,ah_attr) O(ibv_qp_attr,pkey_index) O(ibv_qp_attr,max_rd_atomic) O(ibv_qp_attr,port_num) O(ibv_qp_attr,rnr_retry) O(ibv_qp_attr,rate_limit)
S(ibv_qp_init_attr) O(ibv_qp_init_attr,qp_type)
S(ibv_send_wr) O(ibv_send_wr,opcode) O(ibv_send_wr,wr) O(ibv_send_wr,qp_type)
S(ibv_recv_wr) S(ibv_sge) S(ibv_wc) O(ibv_wc,byte_len) O(ibv_wc,wc_flags)
S(ibv_comp_channel) O(ibv_mr,lkey) O(ibv_mr,rkey)
O(ibv_context,ops) S(ibv_context_ops) O(ibv_context_ops,poll_cq) O(ibv_context_ops,req_notify_cq) O(ibv_context_ops,post_send) O(ibv_context_ops,post_recv)
O(ibv_qp,qp_num) O(ibv_cq,cqe)
return 0;}
