// Loopback TCP throughput of cold regions: K connections, each sender moves
// its share of a SIZE region in 1 MiB slices to a receiver that reads into
// its share of another SIZE region; sender by write() (MODE=copy) or by
// vmsplice+splice through a pipe (MODE=splice: the socket references the
// region's pages, no copy on the sending side). ROUNDS passes over the region.
// HOT ("hot"): every thread resends one 1 MiB buffer into one buffer, as
// iperf3 does, instead of walking the cold regions.
//   ./sp copy|splice K SIZE ROUNDS [hot]       e.g. ./sp copy 8 268435456 8
// Built and run by tools/bench/floors.sh (`floors.sh sp ...`).
// Prints one JSON line: mode, connections, GB/s.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
static int k, rounds, splice_mode, hot;
static size_t total, share;
static char *src, *dst;
static int tx[64], rx[64];
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void die(const char*w){perror(w);exit(1);}
static void *sender(void *a){
    int i=(int)(long)a; int p[2];
    if(splice_mode){ if(pipe(p))die("pipe"); if(fcntl(p[1],F_SETPIPE_SZ,1<<20)<0)die("setpipe"); }
    for(int r=0;r<rounds;r++){
        char *base = hot ? src + (size_t)i*(1<<20) : src + i*share;
        for(size_t off=0; off<share; off+=1<<20){
            char *b = hot ? base : base+off;
            size_t n = 1<<20;
            if(!splice_mode){ size_t d=0; while(d<n){ssize_t w=write(tx[i],b+d,n-d); if(w<=0)die("write"); d+=w;} }
            else { size_t d=0; while(d<n){ struct iovec v={b+d,n-d}; ssize_t m=vmsplice(p[1],&v,1,0); if(m<=0)die("vmsplice"); ssize_t s=0; while(s<m){ssize_t w=splice(p[0],NULL,tx[i],NULL,m-s,SPLICE_F_MOVE|SPLICE_F_MORE); if(w<=0)die("splice"); s+=w;} d+=m; } }
        }
    }
    return NULL;
}
static void *receiver(void *a){
    int i=(int)(long)a;
    for(int r=0;r<rounds;r++){
        char *base = hot ? dst + (size_t)i*(1<<20) : dst+i*share;
        for(size_t off=0; off<share; off+=1<<20){
            char *b = hot ? base : base+off; size_t d=0;
            while(d<(1<<20)){ssize_t g=read(rx[i],b+d,(1<<20)-d); if(g<=0)die("read"); d+=g;}
        }
    }
    return NULL;
}
int main(int c,char**v){
    if(c<5||(strcmp(v[1],"copy")&&strcmp(v[1],"splice"))){fprintf(stderr,"usage: sp copy|splice K SIZE ROUNDS [hot]\n");return 2;}
    splice_mode=!strcmp(v[1],"splice"); hot=c>5&&!strcmp(v[5],"hot");
    k=atoi(v[2]); total=strtoull(v[3],0,0); rounds=atoi(v[4]);
    // Each connection moves whole 1 MiB pieces of its share.
    if(k<1||k>64||rounds<1||total==0||total%((size_t)k<<20)){fprintf(stderr,"sp: K must be 1..64 and SIZE a multiple of K MiB\n");return 2;}
    share=total/k;
    src=mmap(0,total,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
    dst=mmap(0,total,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
    memset(src,7,total); memset(dst,1,total);
    int l=socket(AF_INET,SOCK_STREAM,0); struct sockaddr_in a={.sin_family=AF_INET,.sin_addr.s_addr=htonl(INADDR_LOOPBACK)};
    bind(l,(void*)&a,sizeof a); socklen_t al=sizeof a; getsockname(l,(void*)&a,&al); listen(l,64);
    for(int i=0;i<k;i++){tx[i]=socket(AF_INET,SOCK_STREAM,0); if(connect(tx[i],(void*)&a,sizeof a))die("connect"); rx[i]=accept(l,0,0);}
    pthread_t t[128]; double t0=now();
    for(int i=0;i<k;i++){pthread_create(&t[i],0,sender,(void*)(long)i);pthread_create(&t[k+i],0,receiver,(void*)(long)i);}
    for(int i=0;i<2*k;i++)pthread_join(t[i],0);
    double s=now()-t0;
    if(!hot && memcmp(src,dst,total))fprintf(stderr,"MISMATCH\n");
    printf("{\"mode\":\"%s%s\",\"connections\":%d,\"GBps\":%.2f}\n",v[1],hot?"-hot":"",k,(double)total*rounds/s/1e9);
}
